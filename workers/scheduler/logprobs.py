"""Log probabilities in OpenAI's shape: token ids from the model worker become token text and bytes
(runs in the scheduler process, which holds the tokenizer); prompt log probabilities wait here for the
first output of the choice that reports them.

A byte-level BPE token may be part of a UTF-8 character; its ``bytes`` are the raw bytes it stands for
(what OpenAI's field is for), and its ``token`` text decodes them with U+FFFD for the incomplete part.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import Any

from ipc.logprob_messages import PromptLogprob, PromptLogprobs, SampleLogprobs, TokenLogprob, TopLogprob
from ipc.prompts import SamplingParams
from workers.engine.core.sequence import child_rid

# JSON has no -inf; OpenAI (and vLLM) report a token that cannot be sampled with this value.
FLOOR = -9999.0

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


class PromptLogprobBook:
    """Prompt log probabilities of the requests that asked for them (``prompt_logprobs``), between the model
    worker, which sends them chunk by chunk (``PromptLogprobs``), and each choice's first output, which
    carries them rendered. A recompute after a preemption sends a prompt's positions again: they replace
    what came before, so a prompt is whole (one entry per token after the first) once its last chunk ran."""

    def __init__(self, renderer: LogprobRenderer) -> None:
        self.renderer = renderer
        self._prompts: dict[str, list[int]] = {}  # sequence computing a prompt -> that prompt
        self._raw: dict[str, list[tuple[float, int, list[int], list[float]]]] = {}  # -> entries so far
        self._owner: dict[str, str] = {}  # choice's sequence, until its first output -> who computes its prompt

    def expect(self, rid: str, prompts: list[list[int]], sampling: SamplingParams) -> None:
        """Request ``rid`` computes ``prompts`` (a batch: sequence p computes prompt p, its choice) with n
        choices each (n > 1: the forked choices share the first sequence's prompt); nothing unless asked."""
        n = sampling.n
        if sampling.prompt_logprobs is None:
            return
        for p, ids in enumerate(prompts):
            self._prompts[child_rid(rid, p)] = ids
            self._raw[child_rid(rid, p)] = []
        for index in range(max(n, len(prompts))):
            self._owner[child_rid(rid, index)] = child_rid(rid, index) if len(prompts) > 1 else rid

    def collect(self, chunks: list[PromptLogprobs]) -> None:
        for chunk in chunks:
            raw = self._raw.get(chunk.rid)
            if raw is None:  # aborted while the step ran
                continue
            del raw[chunk.start :]
            raw.extend(zip(chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs, strict=True))

    def take(self, rid: str) -> list[PromptLogprob] | None:
        """The rendered prompt of sequence ``rid``'s choice, once (its first output); None if not asked for."""
        owner = self._owner.pop(rid, None)
        if owner is None:
            return None
        prompt, raw = self._prompts[owner], self._raw[owner]
        if len(raw) != len(prompt) - 1:
            log.error("prompt logprobs of %s: %d positions for a %d-token prompt", owner, len(raw), len(prompt))
        token = self.renderer.token
        out = [PromptLogprob(prompt[0], token(prompt[0])[0], None, 0, [])]
        for token_id, (value, rank, ids, values) in zip(prompt[1:], raw, strict=False):
            top = [(i, token(i)[0], _finite(v)) for i, v in zip(ids, values, strict=True)]
            out.append(PromptLogprob(token_id, token(token_id)[0], _finite(value), rank, top))
        if owner not in self._owner.values():  # its last choice: the prompt is done with
            del self._prompts[owner], self._raw[owner]
        return out

    def drop(self, rid: str) -> None:
        """Forget request ``rid`` (aborted or failed) and all its choices."""
        prefix = f"{rid}/"
        for table in (self._owner, self._prompts, self._raw):
            for key in [k for k in table if k == rid or k.startswith(prefix)]:
                del table[key]
