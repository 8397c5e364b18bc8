"""Encoder worker role (``--encoder-workers N``): vision-tower-only processes that encode a request's images ahead of
the prefill chunks that need them and hand each cache entry to the model workers through a range of the encoder's
CUDA landing pool (CUDA IPC, cuda_landing.py) or a shared-memory landing segment (ipc/encode.py, ipc/landing.py).
``run_encoder_worker`` (process.py) is the entry point; tower.py holds the tower and the encode of a batch of jobs."""
