"""Kernels: the attention interface and backends (SDPA, FlashAttention varlen, FA3, paged decode), the backend
registry, and the Triton/compiled ops (KV write, rotary, SiLU-and-mul, skinny GEMM, window attention, fused ops).
Imports nothing of glimpse above this folder, so every layer and model can build on it."""
