"""Kernel micro-benchmarks: attention, paged decode, rotary, SiLU, skinny GEMM, first-use costs."""
