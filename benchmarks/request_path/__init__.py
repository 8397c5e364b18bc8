"""Benchmarks of the request path before the GPU: tokenizer processes, a fresh image's stages, a multiturn chat's
tokenizer time, grammar engines."""
