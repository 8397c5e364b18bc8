"""Benchmarks against a running server: the load client, its plots, soak, data parallel, first requests."""
