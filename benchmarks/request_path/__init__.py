"""Benchmarks of the request path before the GPU: tokenizer, image preparation, grammars, body hops."""
