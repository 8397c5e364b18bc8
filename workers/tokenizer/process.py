"""The tokenizer process: one per ``--tokenizer-workers``; ``run_tokenizer`` is its entry point.

Request handling lives in ``worker`` (independent of sockets), the sockets and the asyncio loop in ``service``.
Imports: ``ipc``, ``workers.common``, ``workers.config``, the engine's prompt side; never another role.
"""

from __future__ import annotations

import os

import torch
import uvloop
from PIL import Image

from workers.common.proc import setup_child
from workers.config import ServerConfig
from workers.tokenizer.media.image_prep import core_share
from workers.tokenizer.service import serve_tokenizer
from workers.tokenizer.worker import TokenizerWorker


def run_tokenizer(config: ServerConfig, index: int) -> None:
    """Entry point of tokenizer process `index`; returns (exit 0) on Shutdown or when orphaned."""
    log = setup_child(f"glimpse.tokenizer[{index}]", config.log_level)
    # Several tokenizers share the cores with the scheduler; one torch pool per core each would oversubscribe.
    share = core_share(config)
    torch.set_num_threads(share)
    # Pillow hands a decoded image's memory back at once unless it may keep some blocks (up to 16 MB each) for
    # the next image: kept, a 1080p decode writes into warm pages instead of faulting in 6 MB of fresh ones. One
    # per image thread, and one more for the prep thread.
    Image.core.set_blocks_max(share + 1)
    worker = TokenizerWorker(config, index, log)
    try:
        uvloop.run(serve_tokenizer(worker, os.getppid()))
    finally:
        worker.close()
    log.info("stopped")
