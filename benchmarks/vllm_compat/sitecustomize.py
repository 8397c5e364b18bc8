"""Side-by-side harness only (never part of glimpse): lets vLLM 0.24 read a Hub-layout Gemma 4 config under
transformers 5.17. transformers folds ``global_head_dim`` / ``num_global_key_value_heads`` into ``per_layer_config``
(dropping the attributes) and raises on a global read of a per-layer attribute (``head_dim``), while vLLM 0.24 reads
``config.head_dim`` and ``getattr(config, "global_head_dim", config.head_dim)``. Restore both from the first full
attention layer and allow the global read (which then gives the sliding layers' values, as vLLM expects).

Used by copying it into the vLLM tree the harness puts on vLLM's PYTHONPATH:
``cp benchmarks/vllm_compat/sitecustomize.py /tmp/vsite/`` before ``run.sh vllm`` with a ``gemma4-*`` SHAPE."""

import importlib
from types import ModuleType
from typing import Any

_g4: ModuleType | None
try:
    _g4 = importlib.import_module("transformers.models.gemma4.configuration_gemma4")
except Exception:  # noqa: BLE001 - no Gemma 4 in this transformers: nothing to patch
    _g4 = None

if _g4 is not None:
    _orig = _g4.Gemma4TextConfig.__post_init__

    def _post_init(self: Any, **kwargs: Any) -> None:
        _orig(self, **kwargs)
        self.allow_global_per_layer_attribute_access = True
        full = [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
        if full and getattr(self, "_heterogeneity_spec", None) is not None:
            layer = self.per_layer_config[full[0]]
            self.global_head_dim = layer.head_dim
            if getattr(self, "attention_k_eq_v", False):
                self.num_global_key_value_heads = layer.num_key_value_heads

    _g4.Gemma4TextConfig.__post_init__ = _post_init
