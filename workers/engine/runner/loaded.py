"""What start-up work (warm-up, CUDA-graph capture) reads of a model runner: the loaded model, its KV cache and
the config. A protocol, so that ``warmup`` and ``cuda_graphs`` depend on this view and not on ``model_runner``,
which calls them."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from workers.engine.config import EngineConfig
from workers.engine.layers.linear import TPGroup
from workers.engine.models.base import VLModel
from workers.engine.models.model_spec import ModelSpec
from workers.engine.runner.cache_memory import RecurrentState
from workers.engine.runner.launch_poll import LaunchPoll


class LoadedModel(Protocol):
    cfg: EngineConfig
    tp: TPGroup
    device: torch.device
    dtype: torch.dtype
    spec: ModelSpec
    merge: int
    model: VLModel
    # Typed as loosely as VLModel holds them: the families' modules follow LanguageModel / VisionModel
    # structurally and are nn.Modules besides.
    lm: Any
    vision: Any
    kv_caches: list[torch.Tensor]
    num_blocks: int
    num_window_blocks: int  # the sliding layers' own pool (0: none); its block num_window_blocks is scratch
    state: RecurrentState | None  # hybrid models' linear-attention state pools
    launch_poll: LaunchPoll  # where the worker reports finished steps while it launches one (launch_poll.py)
