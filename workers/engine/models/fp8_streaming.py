"""An FP8 checkpoint's language model made FP8 while it loads, one module at a time, so that it never exists whole in
the model dtype.

The model was built with its linear and expert weights deferred (layers/deferred.py: meta tensors). load.py's walk
over the shards tells this class about each language-model tensor just before the model's loader copies it in
(``before``: the parameter it goes to gets memory) and just after (``after``): once every checkpoint tensor of a
parameter has arrived (the model's own ``_loaded`` and ``shards_needed``, which ``check_loaded`` reads too), its
module turns FP8 (fp8_layers.convert_param: the checkpoint's own values and scales, as after a whole load), and the
model-dtype copy goes with the replaced parameter. A StackedExperts converts once both its stacks are filled.

The model dtype then holds only the parameters being filled: with shards written layer by layer, as published
checkpoints are, about one decoder layer's weights (``peak_bytes``); a checkpoint in another order holds more, never
more than the whole model, which is what a load without this held. Modules that stay in the model dtype (the
checkpoint's own bf16 ones, a TP shard that splits a scale block, ``GLIMPSE_FP8_KEEP_DTYPE``) keep their filled
weights, as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from workers.engine.kernels import fp8_gemm
from workers.engine.layers.deferred import materialize
from workers.engine.models.fp8_layers import convert_param, probe_kernels
from workers.engine.models.kv_scales import scale_name
from workers.engine.models.quantization import Fp8Record

log = logging.getLogger("glimpse.fp8")

Route = tuple[str, object]  # (LM parameter name, shard id)


class StreamingFp8:
    def __init__(self, lm: Any, block: int | None) -> None:  # (a DecoderLM: route, unused, shards_needed, _loaded)
        self.lm, self.block = lm, block
        self.device = next(p.device for p in lm.parameters() if not p.is_meta)  # embeddings are never deferred
        self.record: Fp8Record = {}  # canonical checkpoint name -> (scales, shape), the FP8 tensors seen so far
        self.routes: dict[str, list[tuple[object, str]]] = {}  # parameter -> its FP8 tensors seen so far
        self.filling: dict[str, int] = {}  # parameters given memory and not yet done -> their bytes
        self.peak_bytes = 0  # the most bytes ``filling`` held at once
        self.converted = 0

    def _route(self, canonical: str) -> Route | None:
        """The LM parameter a canonical ``lm.*`` tensor fills, None for tensors the model's loader skips."""
        local = canonical[len("lm.") :]
        if self.lm.unused(local) or scale_name(canonical) is not None:
            return None
        name, shard_id = self.lm.route(local)
        return name, shard_id

    def _owner(self, name: str) -> tuple[nn.Module, str] | None:
        owner_name, _, attr = name.rpartition(".")
        try:
            return self.lm.get_submodule(owner_name), attr
        except AttributeError:  # no such parameter: the model's loader raises on it
            return None

    def before(self, canonical: str) -> None:
        """``canonical``'s tensor is about to be copied in: its parameter gets memory if it has none yet."""
        route = self._route(canonical)
        owned = self._owner(route[0]) if route is not None else None
        if route is None or owned is None:
            return
        param = materialize(*owned, self.device)
        if param is not None:
            self.filling[route[0]] = param.numel() * param.element_size()
            self.peak_bytes = max(self.peak_bytes, sum(self.filling.values()))

    def after(self, canonical: str, fp8: tuple[torch.Tensor, torch.Size] | None) -> None:
        """``canonical``'s tensor was copied in (``fp8``: its scales and shape where it was an FP8 tensor): convert its
        module if that filled it."""
        route = self._route(canonical)
        if route is None:
            return
        name, shard_id = route
        if fp8 is not None:
            self.record[canonical] = fp8
            self.routes.setdefault(name, []).append((shard_id, canonical))
        if not self._filled(name):
            return
        owned = self._owner(name)
        if owned is not None and getattr(owned[0], "fp8_grouped", False):  # experts: both stacks, named by gate_up
            prefix = name.rpartition(".")[0]
            stacks = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
            if not all(self._filled(s) for s in stacks):
                return
            self._convert(stacks[0], stacks)
        else:
            self._convert(name, (name,))

    def _filled(self, name: str) -> bool:
        got = self.lm._loaded.get(name, set())
        return None in got or len(got) >= self.lm.shards_needed(name)

    def _convert(self, name: str, params: tuple[str, ...]) -> None:
        if name in self.routes:
            self.converted += convert_param(self.lm, name, self.routes, self.record, self.block)
        for p in params:  # done, FP8 or kept in the model dtype
            self.filling.pop(p, None)

    def finish(self, rank: int) -> int:
        """After the walk: parameters no checkpoint tensor filled (the loader's check has passed, so ones it does
        not need) get memory as a plain build gives them; the FP8 kernels are probed. Returns the layers converted."""
        for module in self.lm.modules():
            for attr, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    materialize(module, attr, self.device)
        probe_kernels(self.lm, self.device)
        if rank == 0:
            peak = (f"; the device's peak allocation so far {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"
                    if self.device.type == "cuda" else "")
            log.info("FP8: %d language-model layers hold FP8 weights (%s scales, GEMM variant %s), converted as they "
                     "loaded: at most %.2f GiB of them held in the model dtype at once%s", self.converted,
                     "128x128 block" if self.block else "per-channel", fp8_gemm.variant(), self.peak_bytes / 2**30, peak)
        return self.converted
