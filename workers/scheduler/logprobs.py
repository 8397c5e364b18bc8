"""Log probabilities in OpenAI's shape: token ids from the model worker become token text and bytes
(runs in the scheduler process, which holds the tokenizer); prompt log probabilities wait here for the
first output of the choice that reports them, packed (ids and float32: the frontend renders their JSON).

A byte-level BPE token may be part of a UTF-8 character; its ``bytes`` are the raw bytes it stands for
(what OpenAI's field is for), and its ``token`` text decodes them with U+FFFD for the incomplete part.
"""

from __future__ import annotations

import logging
import math
from array import array
from functools import lru_cache
from typing import Any

from ipc.logprob_messages import (
    LOGPROB_FLOOR,
    PromptLogprob,
    PromptLogprobs,
    SampleLogprobs,
    TokenLogprob,
    TopLogprob,
)
from ipc.prompts import SamplingParams
from workers.engine.core.sequence import child_rid

FLOOR = LOGPROB_FLOOR  # JSON has no -inf (ipc/logprob_messages.py)

log = logging.getLogger("glimpse.scheduler")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: byte-level BPE writes byte b as chars[b]."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class LogprobRenderer:
    """Turns ``SampleLogprobs`` into ``TokenLogprob`` entries; token text and bytes are cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        raw: bytes
        if isinstance(piece, str) and piece and all(ch in table for ch in piece):
            raw = bytes(table[ch] for ch in piece)
        else:  # an added or special token (or a tokenizer that is not byte-level): its text is its bytes
            raw = str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()
        entry = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = entry
        return entry

    def render(self, token_id: int, lp: SampleLogprobs) -> TokenLogprob:
        text, raw = self.token(token_id)
        top = []
        for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
            t, b = self.token(tid)
            top.append(TopLogprob(t, _finite(value), b))
        return TokenLogprob(text, _finite(lp.logprob), raw, top)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class _Packed:
    """One prompt's entries so far, in flat arrays (8 bytes an entry, not a tuple of Python lists a position)."""

    def __init__(self, prompt: list[int], k: int) -> None:
        self.prompt, self.k = prompt, k
        self.logprobs, self.ranks = array("f"), array("i")
        self.top_ids, self.top_logprobs = array("i"), array("f")

    def put(self, chunk: PromptLogprobs) -> None:
        # A recompute after a preemption sends positions again from ``start``: they replace what was there.
        k, start = self.k, chunk.start
        for arr, cut in ((self.logprobs, start), (self.ranks, start), (self.top_ids, start * k), (self.top_logprobs, start * k)):
            del arr[cut:]
        self.logprobs.extend(chunk.logprobs)
        self.ranks.extend(chunk.ranks)
        for ids, values in zip(chunk.top_ids, chunk.top_logprobs, strict=True):
            if len(ids) != k:  # the model worker takes exactly k (k <= the vocabulary); anything else is a bug
                raise ValueError(f"prompt logprobs of {chunk.rid}: {len(ids)} alternatives, expected {k}")
            self.top_ids.extend(ids)
            self.top_logprobs.extend(values)


class PromptLogprobBook:
    """Prompt log probabilities of the requests that asked for them (``prompt_logprobs``), between the model
    worker, which sends them chunk by chunk (``PromptLogprobs``), and each choice's first output, which
    carries them packed (``PromptLogprob``: ids and float32, the texts of the ids once). A recompute after a
    preemption sends a prompt's positions again: they replace what came before, so a prompt is whole (one
    entry per token after the first) once its last chunk ran."""

    def __init__(self, renderer: LogprobRenderer) -> None:
        self.renderer = renderer
        self._packed: dict[str, _Packed] = {}  # sequence computing a prompt -> its entries so far
        self._owner: dict[str, str] = {}  # choice's sequence, until its first output -> who computes its prompt
        self._readers: dict[str, int] = {}  # computing sequence -> choices that have not taken it yet

    def expect(self, rid: str, prompts: list[list[int]], sampling: SamplingParams) -> None:
        """Request ``rid`` computes ``prompts`` (a batch: sequence p computes prompt p, its choice) with n
        choices each (n > 1: the forked choices share the first sequence's prompt); nothing unless asked."""
        n, k = sampling.n, sampling.prompt_logprobs
        if k is None:
            return
        for p, ids in enumerate(prompts):
            self._packed[child_rid(rid, p)] = _Packed(ids, k)
        for index in range(max(n, len(prompts))):
            owner = child_rid(rid, index) if len(prompts) > 1 else rid
            self._owner[child_rid(rid, index)] = owner
            self._readers[owner] = self._readers.get(owner, 0) + 1

    def collect(self, chunks: list[PromptLogprobs]) -> None:
        for chunk in chunks:
            packed = self._packed.get(chunk.rid)
            if packed is not None:  # None: aborted while the step ran
                packed.put(chunk)

    def take(self, rid: str) -> PromptLogprob | None:
        """The packed prompt of sequence ``rid``'s choice, once (its first output); None if not asked for."""
        owner = self._owner.pop(rid, None)
        if owner is None:
            return None
        packed = self._packed[owner]
        prompt = array("i", packed.prompt)
        if len(packed.logprobs) != len(prompt) - 1:
            log.error("prompt logprobs of %s: %d positions for a %d-token prompt", owner, len(packed.logprobs), len(prompt))
        vocab = array("i", sorted(set(prompt) | set(packed.top_ids)))
        token = self.renderer.token
        out = PromptLogprob(
            prompt.tobytes(), packed.logprobs.tobytes(), packed.ranks.tobytes(), packed.k, packed.top_ids.tobytes(),
            packed.top_logprobs.tobytes(), vocab.tobytes(), [token(i)[0] for i in vocab],
        )  # fmt: skip
        self._readers[owner] -= 1
        if not self._readers[owner]:  # its last choice: the prompt is done with
            del self._packed[owner], self._readers[owner]
        return out

    def drop(self, rid: str) -> None:
        """Forget request ``rid`` (aborted or failed) and all its choices."""
        prefix = f"{rid}/"
        for table in (self._owner, self._packed, self._readers):
            for key in [k for k in table if k == rid or k.startswith(prefix)]:
                del table[key]
