"""What start-up work (warm-up, CUDA-graph capture) reads of a model runner: the loaded model, its KV cache and
the config. A protocol, so that ``warmup`` and ``cuda_graphs`` depend on this view and not on ``model_runner``,
which calls them."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from workers.engine.config import EngineConfig
from workers.engine.layers.linear import TPGroup
from workers.engine.models.base import ModelSpec, VLModel


class LoadedModel(Protocol):
    @property
    def cfg(self) -> EngineConfig: ...
    @property
    def tp(self) -> TPGroup: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def merge(self) -> int: ...
    @property
    def model(self) -> VLModel: ...
    # Typed as loosely as VLModel holds them: the families' modules follow LanguageModel / VisionModel
    # structurally and are nn.Modules besides.
    @property
    def lm(self) -> Any: ...
    @property
    def vision(self) -> Any: ...
    @property
    def kv_caches(self) -> list[torch.Tensor]: ...
    @property
    def num_blocks(self) -> int: ...
