"""The inference engine, a library the three process roles use, in rooms by concern (bottom up):

- ``kernels/``: attention backends and their registry, paged decode, Triton and fused ops. Imports nothing above.
- ``layers/``: tensor-parallel linears, RMSNorm, vision attention and MLP, ViT call plans.
- ``models/``: the family interface, the registry, weight loading, M-RoPE, the demo writer, and one package per
  family (nothing outside ``models/`` imports a family package).
- ``prompt/``: the multimodal processor (placeholders, grids, pixel frames) and video prompts.
- ``core/``: sequences, the paged KV allocator with prefix caching, the embedding-cache index, the scheduling core.
- ``runner/``: the model runner that executes a step plan, step inputs, sampling and logits processing, structured
  output masks, decode and piecewise CUDA graphs, warm-up.
- ``config.py``: ``EngineConfig``; ``offline.py``: all of it in one process (tests and benchmarks).
"""
