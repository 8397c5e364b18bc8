"""The OpenAI (legacy) completions request: a raw prompt, no chat template, no images.

The prompt is a string, tokenized as the model's own text (special-token strings in it are control
tokens: a raw prompt is how a client writes its own template), or token ids. The sampling fields and
their checks are the chat endpoint's (workers/sampling_request.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ipc.messages import GenerateRequest, RequestAccepted, TokenizedRequest
from workers.chat_request import decode_body
from workers.engine.processor import Prompt, Rendered
from workers.errors import BadRequest
from workers.sampling_request import (
    MAX_TOP_LOGPROBS,
    SamplingFields,
    check_sampling,
    range_error,
    to_sampling_params,
    unsupported,
)

if TYPE_CHECKING:
    from workers.tokenizer import TokenizerWorker


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    # One prompt: a string, token ids, or a list holding exactly one of those (what some clients send).
    # (msgspec takes one array type per union, so the list's items are checked by hand.)
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None  # 0-20: the sampled token's and the k best tokens' log probabilities
    suffix: str | None = None
    best_of: int | None = None


_decoder = msgspec.json.Decoder(CompletionRequest)


def parse_completion(body: bytes) -> CompletionRequest:
    req = decode_body(_decoder, body)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise range_error("max_tokens", req.max_tokens, ">= 1")
    check_sampling(req, req.max_tokens)
    if isinstance(req.prompt, list):
        nested = [p for p in req.prompt if not isinstance(p, int)]
        if nested and len(req.prompt) != 1:
            raise unsupported("prompt", "one prompt per request (send a string or a list of token ids)")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise range_error("logprobs", req.logprobs, f"between 0 and {MAX_TOP_LOGPROBS}")
    if req.echo and req.logprobs is not None:
        raise unsupported("echo", "echo with logprobs needs the prompt's log probabilities, which are not computed")
    if req.suffix:
        raise unsupported("suffix", "insertion (text after the completion) is not served")
    if req.best_of is not None and req.best_of != req.choices:
        raise unsupported("best_of", "only best_of equal to n (every candidate is returned)")
    return req


def _one_prompt(req: CompletionRequest) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and not isinstance(prompt[0], int):
        first = prompt[0]
        return first if isinstance(first, str) else list(first)
    return [t for t in prompt if isinstance(t, int)]  # all ints: parse_completion refused mixed lists


def prepare_completion(
    worker: TokenizerWorker, req: GenerateRequest, completion: CompletionRequest
) -> tuple[RequestAccepted, TokenizedRequest]:
    """Tokenize a completions prompt and build what the frontend and the scheduler get."""
    processor, limit = worker.processor, worker.max_model_len
    raw = _one_prompt(completion)
    if isinstance(raw, str):
        if not raw:
            raise range_error("prompt", "", "that is a non-empty string")
        if len(raw) > worker.max_text_chars:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens; the prompt is longer.",
                param="prompt",
                code="context_length_exceeded",
            )
        try:
            prompt = processor.build(Rendered([(raw, False)]), [])
        except ValueError as exc:  # image placeholders typed into a prompt that has no images
            raise BadRequest(f"The prompt cannot be used: {exc}", param="prompt") from None
        ids = prompt.input_ids
    else:
        vocab = processor.info.vocab_size
        if not raw:
            raise range_error("prompt", [], "that is a non-empty list of token ids")
        bad = next((t for t in raw if not 0 <= t < vocab or t == processor.info.image_token_id), None)
        if bad is not None:
            raise range_error("prompt", bad, f"made of text token ids below {vocab}")
        ids = raw
        prompt = Prompt(ids, processor.family.delta(len(ids), [], processor.merge), [])
    sampling = to_sampling_params(
        completion,
        len(ids),
        limit,
        requested_max_tokens=completion.max_tokens,
        logprobs=completion.logprobs,
        defaults=worker.config.sampling_defaults,
        vocab_size=processor.info.vocab_size,
        prompt_param="prompt",
        validate=worker.structured.check,
    )
    echo = (raw if isinstance(raw, str) else processor.decode(ids)) if completion.echo else ""
    accepted = RequestAccepted(
        req.rid, completion.stream, completion.include_usage, completion.model, len(ids), worker.index,
        sampling.n, "completion", echo, sampling.logprobs is not None,
    )
    return accepted, TokenizedRequest(req.rid, ids, prompt.mrope_delta, [], sampling, [], 0)
