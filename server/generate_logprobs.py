"""SGLang's log probabilities in /generate's ``meta_info`` (``return_logprob``), rendered in slices as the completions
answer renders its own (server/completion_answer.py): a prompt's entries can reach millions.

Every entry names its token by id: ``[logprob, token_id, text]``, the text only with ``return_text_in_logprobs``
(else null). ``input_token_logprobs`` covers the prompt from ``logprob_start_len`` (position 0's logprob is null:
nothing comes before it) and ``output_token_logprobs`` the generated tokens. With ``top_logprobs_num`` k > 0,
``input_top_logprobs`` and ``output_top_logprobs`` hold each position's k best entries, best first (null at
position 0). This is what lm-eval's ``sglang-generate`` model sums for a loglikelihood.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipc.logprob_messages import TokenLogprob
from server.completion_answer import PromptRows, finite, json_list, key

_SLICE_ENTRIES = 2048  # entries encoded at once, as completion_answer's

Entry = list[Any]  # [logprob | None, token id, text | None]


@dataclass
class ChoiceLogprobs:
    """One choice's log probabilities as they arrive: the prompt's (with its first output) and the generated
    tokens' not yet written (a stream writes each once; a whole answer all of them)."""

    prompt: PromptRows | None = None
    ids: list[int] = field(default_factory=list)
    entries: list[TokenLogprob] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)  # flat: len(entries[j].top_logprobs) per entry

    def add(self, ids: list[int], entries: list[TokenLogprob] | None, top_ids: list[int] | None) -> None:
        if entries:
            self.ids.extend(ids)
            self.entries.extend(entries)
            self.top_ids.extend(top_ids or [])

    def take(self) -> ChoiceLogprobs:
        """What is unwritten, handed over; this keeps nothing of it (a stream's next event starts afresh)."""
        taken = ChoiceLogprobs(self.prompt, self.ids, self.entries, self.top_ids)
        self.prompt, self.ids, self.entries, self.top_ids = None, [], [], []
        return taken


def meta_pieces(lp: ChoiceLogprobs, start: int | None, k: int, text: bool, with_input: bool) -> Iterator[bytes]:
    """The log-prob keys of one meta_info, each led by a comma: the input ones when ``with_input`` (a whole answer,
    or a stream's first event), from prompt position ``start`` (None: none asked for)."""
    prompt = lp.prompt
    first = min(start, prompt.size) if start is not None and prompt is not None else 0
    count = prompt.size - first if start is not None and prompt is not None else 0
    step = max(1, _SLICE_ENTRIES // (k + 1))

    def name(i: int) -> str | None:
        return prompt.text[prompt.ids[i]] if text and prompt is not None else None

    def inputs(a: int, b: int) -> list[Entry]:
        assert prompt is not None
        out = []
        for i in range(first + a, first + b):
            out.append([None if i == 0 else finite(prompt.logprobs[i - 1]), prompt.ids[i], name(i)])
        return out

    def input_tops(a: int, b: int) -> list[list[Entry] | None]:
        assert prompt is not None
        out: list[list[Entry] | None] = []
        for i in range(first + a, first + b):
            out.append(None if i == 0 else [[v, t, prompt.text[t] if text else None] for t, v in prompt.top_ids_at(i, k)])
        return out

    outputs, tops = _output_rows(lp, text)
    if with_input:
        yield b"," + key("input_token_logprobs")
        yield from json_list(count, inputs, step)
    yield b"," + key("output_token_logprobs")
    yield from json_list(len(outputs), lambda a, b: outputs[a:b], step)
    if k > 0:
        if with_input:
            yield b"," + key("input_top_logprobs")
            yield from json_list(count, input_tops, step)
        yield b"," + key("output_top_logprobs")
        yield from json_list(len(tops), lambda a, b: tops[a:b], step)


def _output_rows(lp: ChoiceLogprobs, text: bool) -> tuple[list[Entry], list[list[Entry]]]:
    rows, tops, at = [], [], 0
    for tid, e in zip(lp.ids, lp.entries, strict=True):
        rows.append([e.logprob, tid, e.token if text else None])
        ids: Sequence[int] = lp.top_ids[at : at + len(e.top_logprobs)]
        at += len(e.top_logprobs)
        tops.append([[t.logprob, i, t.token if text else None] for t, i in zip(e.top_logprobs, ids, strict=True)])
    return rows, tops
