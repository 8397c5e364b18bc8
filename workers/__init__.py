"""The processes behind the frontend, and the engine they run.

- ``tokenizer/``: one process per ``--tokenizer-workers``; request parsing, media fetch, hashing, image and video
  preparation into shared memory, the chat template and tokenization.
- ``scheduler/``: one process per replica; admission, continuous batching, the embedding-cache index, the shm
  ledger, KV events, detokenization and the stats it reports.
- ``model/``: one process per GPU (TP rank); runs the scheduler's step plans on the engine's model runner.
- ``engine/``: the library all three use, in rooms by concern (kernels, layers, models, prompt, core, runner).
- ``common/``: what several roles share (errors, tool calls, the detokenizer, process set-up, step traces).
- ``config.py``: the frozen ``ServerConfig`` the launcher builds and every process is given.

Roles talk only through ``ipc`` messages and never import one another (tests/test_layering.py).
"""
