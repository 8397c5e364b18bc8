"""Benchmarks of the engine in one process: steps, families, TP, ViT, video, graphs, plans and sampling."""
