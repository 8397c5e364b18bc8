"""Kernel micro-benchmarks on CUDA: attention, paged decode, rotary, SiLU-and-mul, skinny GEMM."""
