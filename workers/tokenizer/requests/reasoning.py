"""What a chat request's answer continues, for the reasoning split (``--reasoning-parser``), and the reasoning's token
budget."""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.prompts import SamplingParams
from workers.common.reasoning_markers import PARSERS
from workers.tokenizer.requests.chat import ChatCompletionRequest, TextPart
from workers.tokenizer.requests.sampling import unsupported


def continued_text(chat: ChatCompletionRequest, prompt_text: str) -> str | None:
    """With ``continue_final_message``: the assistant message's text the prompt ends with (its last text part), so
    the split starts inside the reasoning when that text opened it (``<think>`` and no ``</think>`` after). None
    without it, or when the template rewrote the message (the prompt does not end with its text): then the prompt's
    end alone decides, as for a generation prompt."""
    if not chat.continue_final_message:
        return None
    content = chat.messages[-1].content
    if isinstance(content, str):
        text = content
    else:
        texts = [p.text for p in content or [] if isinstance(p, TextPart)]
        text = texts[-1] if texts else ""
    # Templates trim a message's text; transformers ends the prompt right after what the template wrote of it.
    return text if text.strip() and prompt_text.rstrip().endswith(text.strip()) else None


def with_think_budget(
    sampling: SamplingParams, chat: ChatCompletionRequest, parser: str, inside: bool, tokenizer: Any
) -> SamplingParams:
    """vLLM's ``thinking_token_budget`` on the sampling settings: the reasoning's start and end markers as the ids
    the sampler watches for (each must be one token of the vocabulary) and whether the prompt opened it. A 400
    naming the field where nothing splits the reasoning off (no ``--reasoning-parser``, or a raw prompt)."""
    budget = chat.thinking_token_budget
    if budget is None:
        return sampling
    if not parser:
        raise unsupported("thinking_token_budget", "it bounds the reasoning that --reasoning-parser splits off, and "
                          "this answer has none (the server runs without one, or the prompt is raw text)")
    markers = PARSERS[parser]
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in (markers.start, markers.end)]
    if any(len(i) != 1 for i in ids):
        raise unsupported("thinking_token_budget", f"the reasoning markers {markers.start!r} / {markers.end!r} are "
                          "not single tokens of this model's vocabulary")
    # No answer outlasts its max_tokens, so a larger budget is the same bound (and the device counts in int64).
    budget = min(budget, sampling.max_tokens)
    return msgspec.structs.replace(sampling, think_budget=budget, think_ids=(ids[0][0], ids[1][0]), think_inside=inside)
