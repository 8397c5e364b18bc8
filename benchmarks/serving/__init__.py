"""Benchmarks against a running server: the load client and its plots, soak, data parallel, a fresh server's first
requests."""
