"""What the Gemma 4 language-model tests share: tiny random transformers models (``Gemma4ForCausalLM`` from a
``Gemma4TextConfig``, every weight drawn away from its init so a misplaced norm or scale shows), their weights under
the Hub's names loaded into glimpse's LM, a driver that runs it step by step through paged KV caches of several shapes
(blocks handed out in shuffled order), and a reference attention backend with sliding windows, in-image bidirectional
spans and KV-shared layers written straight from the protocol's words (masks built per sequence)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from tests.workers.engine.models.lm_harness import BLOCK_SIZE, PagedCache
from workers.engine.kernels.attention import AttentionMetadata, gather_sequence_kv, write_new_kv
from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models.gemma4.lm import Gemma4LanguageModel, build_language_model
from workers.engine.models.gemma4.spec import FULL, SLIDING, TextSpec
from workers.engine.models.loader import normalize_name

BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 64,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    "hidden_size_per_layer_input": 0,
    "max_position_embeddings": 512,
    "eos_token_id": None,
    "pad_token_id": 0,
    "bos_token_id": 2,
}
# (a)-(e) of the brief, each variant adding its features to BASE (sliding + full layers, global head dim 16, k_eq_v).
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"final_logit_softcapping": 3.0, "tie_word_embeddings": False},
    "shared": {"num_kv_shared_layers": 2, "use_double_wide_mlp": True, "attention_k_eq_v": False},
    "ple": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128, "num_kv_shared_layers": 2},
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
}


def text_config(variant: str, **overrides: Any) -> Any:
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**BASE, **VARIANTS[variant], **overrides})


def reference(config: Any, seed: int = 0) -> Any:
    """transformers' Gemma4ForCausalLM with every parameter random: linears N(0, 0.15), embeddings N(0, 1), norm weights
    and scales (router, per-expert, layer scalars) 1 + U(-0.3, 0.3), so each one's place in the math matters."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.6 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif name.endswith("embed_tokens.weight"):
                # Rows of one norm: a tied head then favours no token for its row's length alone (random models
                # otherwise answer one token over and over).
                rows = torch.randn(p.shape, generator=gen)
                p.copy_(rows / rows.norm(dim=-1, keepdim=True) * 2.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.6 * (torch.rand(b.shape, generator=gen) - 0.5))
    return model


def hub_weights(hf: Any) -> dict[str, Tensor]:
    """The model's tensors under Gemma4ForConditionalGeneration's Hub names (``model.language_model.*``)."""
    out = {}
    for name, t in hf.state_dict().items():
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t.clone()
    return out


def hub_config(config: Any) -> dict[str, Any]:
    """config.json of a Gemma4ForConditionalGeneration with this text config (as transformers saves it)."""
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": config.to_dict(),
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def load_ours(hf: Any, tp: TPGroup = SINGLE_RANK) -> Gemma4LanguageModel:
    spec = TextSpec.from_hf_config(hub_config(hf.config))
    lm = build_language_model(spec, tp=tp, dtype=torch.float32, device="cpu")
    lm.load_weights((normalize_name(n), t) for n, t in hub_weights(hf).items())
    return lm


class MaskedSdpaBackend:
    """The protocol of kernels/attention.py by its words: per sequence, keys [0, seq_len) read through the block table;
    query i (absolute position) sees key j when j <= i, or both sit in one span of ``meta.bidir_spans`` (if
    ``bidirectional``), and then only if i - window < j (if ``window``). k = v = None: attend only."""

    name = "masked_sdpa"
    honours_kv_written = True

    def forward(
        self, q: Tensor, k: Tensor | None, v: Tensor | None, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, bidirectional: bool = False,
    ) -> Tensor:
        if k is not None and v is not None:
            write_new_kv(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        start = 0
        for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            keys, values = gather_sequence_kv(kv_cache, meta.block_tables[b], s_len)
            qi = torch.arange(s_len - q_len, s_len)[:, None]
            kj = torch.arange(s_len)[None, :]
            allowed = kj <= qi
            if bidirectional and meta.bidir_spans is not None:
                for lo, hi in meta.bidir_spans[b]:
                    allowed |= (qi >= lo) & (qi < hi) & (kj >= lo) & (kj < hi)
            if window:
                allowed &= kj > qi - window
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=allowed, scale=scale, enable_gqa=True,
            )
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out


@dataclass
class GemmaCache(PagedCache):
    """PagedCache with one cache per KV-owning layer, each in its own shape (``kv_cache_shapes``)."""

    backend: Any = None  # None: the model's own (SdpaBackend on the CPU)
    # (embeds, positions, caches, meta, backend) -> hidden states in the model's stead (e.g. through piecewise graphs)
    forward: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.caches = [torch.zeros(s, dtype=self.dtype) for s in self.model.kv_cache_shapes(self.num_blocks, BLOCK_SIZE)]

    def step(
        self,
        chunks: list[tuple[str, Tensor]],
        rows: dict[str, Tensor] | None = None,
        spans: dict[str, list[tuple[int, int]]] | None = None,
    ) -> list[Tensor]:
        """One flattened forward over ``(seq, new token ids)`` chunks -> each chunk's float32 logits. ``rows[seq]``
        (token rows over the whole sequence, images spliced in) replaces ``embed_tokens``; ``spans[seq]`` are the
        sequence's image spans (absolute [start, end)), set on the metadata as the runner does."""
        lm: Gemma4LanguageModel = self.model
        meta, starts = self.schedule([(s, len(ids)) for s, ids in chunks])
        if spans is not None:
            meta.bidir_spans = [spans.get(s, []) for s, _ in chunks]
        with torch.no_grad():
            embeds, pos = [], []
            for (s, ids), start in zip(chunks, starts, strict=True):
                end = start + len(ids)
                embeds.append(rows[s][start:end] if rows and s in rows else lm.embed_tokens(ids))
                pos.append(torch.arange(start, end))
            positions = torch.cat(pos).expand(3, -1)
            hidden = (self.forward or lm)(torch.cat(embeds), positions, self.caches, meta, self.backend)
            logits = lm.compute_logits(hidden)
        return list(logits.split([len(ids) for _, ids in chunks]))


def greedy(
    cache: GemmaCache, prompts: dict[str, Tensor], plan: Iterable[dict[str, int]], new: int
) -> dict[str, tuple[list[int], Tensor]]:
    """Greedy answers of ``new`` tokens to prompts sharing steps as the scheduler mixes them, and the logits each token
    was picked from ([new, vocab]): each step of ``plan`` (seq -> prompt tokens this step) also decodes one token of
    every sequence whose prompt is done (decodes first); after the plan, decode steps until every answer is whole."""
    fed = dict.fromkeys(prompts, 0)
    out: dict[str, list[int]] = {s: [] for s in prompts}
    picked: dict[str, list[Tensor]] = {s: [] for s in prompts}
    steps = list(plan)
    while steps or any(len(o) < new for o in out.values()):
        step = steps.pop(0) if steps else {}
        assert step or all(fed[s] == len(p) for s, p in prompts.items()), "the plan must feed every prompt whole"
        decodes = [(s, torch.tensor(out[s][-1:])) for s in prompts if out[s] and len(out[s]) < new]
        chunks = decodes + [(s, prompts[s][fed[s] : fed[s] + n]) for s, n in step.items()]
        for (s, ids), logits in zip(chunks, cache.step(chunks), strict=True):
            if fed[s] < len(prompts[s]):
                fed[s] += len(ids)
                if fed[s] < len(prompts[s]):
                    continue
            out[s].append(int(logits[-1].argmax()))
            picked[s].append(logits[-1])
    return {s: (out[s], torch.stack(picked[s])) for s in prompts}


# transformers 5.24 drops the prompt's rows before the KV-shared layers (``_maybe_slice_kv_shared_inputs``) and then
# indexes the per-layer inputs, which a model without PLE does not have: asking for hidden states turns that off.
NO_SLICING = {"output_hidden_states": True}


def hf_greedy(hf: Any, ids: Tensor, new: int) -> tuple[list[int], Tensor]:
    """transformers' greedy continuation (its own KV cache) and the logits of each step, [new, vocab]."""
    with torch.inference_mode():
        out = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, **NO_SLICING)
    return [int(t) for t in out.sequences[0, len(ids) :]], torch.cat(out.logits).float()


def hf_logits(hf: Any, ids: Tensor) -> Tensor:
    with torch.no_grad():
        logits: Tensor = hf(input_ids=ids[None], **NO_SLICING).logits[0]
    return logits
