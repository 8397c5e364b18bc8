"""What the Qwen3.5 tests share: the demo checkpoints loaded into glimpse's model (TP 1 or one rank of a TP group) and
into transformers, and a runner that drives the hybrid LM step by step as the model runner does: flattened batches
of chunks, a paged KV cache for the full-attention layers (blocks handed out in shuffled order), and one state slot
per sequence in the linear-attention layers' pools, with ``has_initial`` and snapshots set by hand."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.workers.engine.models.lm_harness import BLOCK_SIZE, PagedCache
from workers.engine.kernels.attention import StateMetadata
from workers.engine.layers.linear import SINGLE_RANK, TPGroup
from workers.engine.models import family, load_spec
from workers.engine.models.base import VLModel
from workers.engine.models.load import load_model
from workers.engine.models.qwen3_5.lm import Qwen3_5LanguageModel


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread while a module runs (autouse where imported). These models are tiny: with torch's default
    threads per core, each of the thousands of small ops pays a fork/join, and on a busy 2-core box the spinning
    threads make the module ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_ours(model_dir: Path, tp: TPGroup = SINGLE_RANK) -> VLModel:
    """The demo checkpoint in glimpse's Qwen3.5 model (float32, CPU), through the family's parse, build and loader."""
    spec = load_spec(model_dir)
    model = family("qwen3_5").build(spec, tp, torch.float32, torch.device("cpu"), "auto")
    return load_model(model, model_dir, rank=tp.rank)


def load_reference(model_dir: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@dataclass
class HybridCache(PagedCache):
    """PagedCache with KV for the full-attention layers only, plus state pools and a slot per sequence."""

    num_slots: int = 8
    slots: dict[str, int] = field(default_factory=dict)
    pools: list[Tensor] = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        lm: Qwen3_5LanguageModel = self.model
        self.caches = self.caches[: lm.num_kv_layers]  # one per full-attention layer, in layer order
        self.pools = lm.allocate_state(self.num_slots, self.dtype)

    def copy_slot(self, src: int, dst: int) -> None:
        """What the runner does to restore a snapshot or fork a sequence: ``t[dst] = t[src]`` in every pool."""
        for pool in self.pools:
            pool[dst] = pool[src]

    def share_prefix(self, seq: str, parent: str, tokens: int, slot: int) -> None:
        """Start ``seq`` as a prefix-cache hit on ``parent``'s first ``tokens`` tokens (whole blocks): its block table
        begins with the parent's blocks, its state is in ``slot`` (a copy of a snapshot taken there)."""
        assert tokens % BLOCK_SIZE == 0
        self.tables[seq] = list(self.tables[parent][: tokens // BLOCK_SIZE])
        self.done[seq] = tokens
        self.slots[seq] = slot

    def step(
        self,
        chunks: list[tuple[str, Tensor]],
        positions: dict[str, Tensor] | None = None,
        snapshots: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
        embeds: dict[str, Tensor] | None = None,
    ) -> list[Tensor]:
        """One flattened forward over ``(seq, new token ids)`` chunks; returns each chunk's float32 logits. Positions are
        text positions unless ``positions[seq]`` ([3, T] over the whole sequence) is given. A sequence without a slot
        gets the next free one; it has initial state iff it has tokens before this chunk. ``snapshots``: (seq, n, slot)
        copies that sequence's state after its first n new tokens into ``slot``. ``embeds[seq]`` ([T, hidden] over the
        whole sequence, images spliced in) replaces the token embeddings."""
        lm: Qwen3_5LanguageModel = self.model
        meta, starts = self.schedule([(s, len(ids)) for s, ids in chunks])
        names = [s for s, _ in chunks]
        for s in names:
            self.slots.setdefault(s, len(self.slots))
        slots = [self.slots[s] for s in names]
        initial = [start > 0 for start in starts]
        meta.state = StateMetadata(
            slots=torch.tensor(slots),
            slots_cpu=slots,
            has_initial=torch.tensor(initial),
            has_initial_cpu=initial,
            snapshots=[(names.index(s), n, slot) for s, n, slot in snapshots],
        )
        pos, rows = [], []
        with torch.no_grad():
            for (s, ids), start in zip(chunks, starts, strict=True):
                given = positions[s] if positions and s in positions else torch.arange(start + len(ids)).expand(3, -1)
                pos.append(given[:, start : start + len(ids)])
                rows.append(embeds[s][start : start + len(ids)] if embeds and s in embeds else lm.embed_tokens(ids))
            hidden = lm(torch.cat(rows), torch.cat(pos, dim=1), self.caches, meta)
            logits = lm.compute_logits(hidden)
        return list(logits.split([len(ids) for _, ids in chunks]))


def greedy(
    cache: HybridCache, prompts: dict[str, Tensor], plan: list[dict[str, int]], new_tokens: int
) -> dict[str, list[int]]:
    """Greedy answers of ``new_tokens`` tokens to several prompts sharing steps, as the scheduler mixes them: each
    step of ``plan`` (seq -> prompt tokens this step) also decodes one token of every sequence whose prompt is done
    (decodes first in the batch); after the plan, decode steps until every answer is whole."""
    fed = {s: cache.done.get(s, 0) for s in prompts}  # a resumed prefix is already in
    out: dict[str, list[int]] = {s: [] for s in prompts}
    steps = [*plan]
    while steps or any(len(o) < new_tokens for o in out.values()):
        step = steps.pop(0) if steps else {}
        assert step or all(fed[s] == len(p) for s, p in prompts.items()), "the plan must feed every prompt whole"
        decodes = [(s, torch.tensor(out[s][-1:])) for s in prompts if out[s] and len(out[s]) < new_tokens]
        chunks = decodes + [(s, prompts[s][fed[s] : fed[s] + n]) for s, n in step.items()]
        for (s, ids), logits in zip(chunks, cache.step(chunks), strict=True):
            if fed[s] < len(prompts[s]):
                fed[s] += len(ids)
                if fed[s] < len(prompts[s]):
                    continue
            out[s].append(int(logits[-1].argmax()))
    return out


def hf_greedy(hf: Any, ids: Tensor, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of a text prompt (shorter if it ends on a stop token)."""
    with torch.inference_mode():
        out = hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]
