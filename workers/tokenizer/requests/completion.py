"""The OpenAI (legacy) completions request: a raw prompt, no chat template; images only through SGLang's
``image_data`` (workers/tokenizer/requests/image_data.py serves such a request on the chat path).

The prompt is a string, tokenized as the model's own text (special-token strings in it are control
tokens: a raw prompt is how a client writes its own template), or token ids; or a batch of them (a list of
strings and token-id lists, what lm-eval sends), choice p answering prompt p. The sampling fields and
their checks are the chat endpoint's (workers/tokenizer/requests/sampling.py).

``echo`` with ``logprobs`` (and vLLM's ``prompt_logprobs``) asks for the prompt's log probabilities, which
the model worker computes for every prompt position (workers/engine/runner/prompt_logprobs.py); ``max_tokens`` 0
with ``echo`` computes the prompt alone (a loglikelihood, no generation).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from ipc.prompts import TokenizedRequest
from ipc.requests import GenerateRequest, RequestAccepted
from workers.common.errors import BadRequest
from workers.config import ServerConfig
from workers.engine.prompt.media_items import Prompt
from workers.engine.prompt.processor import MMProcessor, Rendered
from workers.engine.runner.grammar import Validator
from workers.tokenizer.requests.chat import decode_body
from workers.tokenizer.requests.mm_kwargs import media_settings
from workers.tokenizer.requests.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingFields,
    check_sampling,
    hold_to_budget,
    range_error,
    to_sampling_params,
    unsupported,
)


class PromptContext(Protocol):
    """What tokenizing a completions prompt reads of its tokenizer worker."""

    processor: MMProcessor
    config: ServerConfig
    structured: Validator
    index: int
    max_model_len: int
    max_text_chars: int


MAX_PROMPTS = 1024  # prompts of one batch: each is a sequence (and a choice) of its own
# Endpoints whose bodies become a completions request but are answered in their own shapes (server/app.py).
_OWN_ANSWERS = frozenset({"generate", "vllm_generate"})


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    # A string, token ids, or a batch: a list of strings and token-id lists (one item: one prompt).
    # (msgspec takes one array type per union, so the list's items are checked by hand.)
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None  # 0-20: the sampled token's and the k best tokens' log probabilities
    prompt_logprobs: int | None = None  # vLLM-style extension: choices[].prompt_logprobs, 0-20 best per position
    suffix: str | None = None
    best_of: int | None = None
    prompt_embeds: Any = None  # vLLM's prompt as embeddings (base64 tensors)
    # vLLM's: a text prompt gets the special tokens the tokenizer adds of its own accord (Gemma's <bos>; none for
    # Qwen's), as ``tokenizer(prompt)`` does. Token-id prompts are taken as sent.
    add_special_tokens: bool = True
    # vLLM's multimodal processor settings: checked as for chat, applied to image_data's images.
    mm_processor_kwargs: dict[str, Any] | None = None
    # SGLang's images beside the prompt (``sglang.bench_serving --backend sglang-oai`` sends them): one or a list of
    # URLs, paths or base64, checked and served by image_data.completion_images; None or "": a text prompt.
    image_data: Any = None


_decoder = msgspec.json.Decoder(CompletionRequest)


def parse_completion(body: bytes | memoryview) -> CompletionRequest:
    req = decode_body(_decoder, body)
    if req.max_tokens is not None and req.max_tokens < (0 if req.echo else 1):
        raise range_error("max_tokens", req.max_tokens, ">= 1 (0 only with echo: the prompt alone)")
    check_sampling(req, req.max_tokens)
    if isinstance(req.prompt, list):
        nested = [p for p in req.prompt if not isinstance(p, int)]
        if nested and len(nested) != len(req.prompt):
            raise range_error("prompt", "a list mixing token ids and prompts", "of token ids or of prompts")
        if len(nested) > MAX_PROMPTS:
            raise range_error("prompt", f"{len(nested)} prompts", f"of at most {MAX_PROMPTS} prompts")
        if len(nested) > 1 and req.choices > 1:
            raise unsupported("n", "n > 1 with a batch of prompts (send n = 1, or one prompt per request)")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise range_error("logprobs", req.logprobs, f"between 0 and {MAX_TOP_LOGPROBS}")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise range_error("prompt_logprobs", req.prompt_logprobs, f"between 0 and {MAX_TOP_LOGPROBS}")
        if req.stream:  # as vLLM: a stream has no place for them (echo with logprobs streams the prompt's)
            raise unsupported("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    if req.suffix:
        raise unsupported("suffix", "insertion (text after the completion) is not served")
    if req.thinking_token_budget is not None:
        raise unsupported("thinking_token_budget", "a text completion's answer is raw text, with no reasoning split off")
    if req.prompt_embeds:
        raise unsupported("prompt_embeds", "prompts are text or token ids (embeddings as input are not served)")
    if req.best_of is not None and req.best_of != req.choices:
        raise unsupported("best_of", "only best_of equal to n (every candidate is returned)")
    return req


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [[t for t in prompt if isinstance(t, int)]]  # all ints: parse_completion refused mixed lists
    return [p if isinstance(p, str) else list(p) for p in prompt if not isinstance(p, int)]


def _batched(req: CompletionRequest) -> bool:
    """The prompt is a list of prompts (of one or more), not one prompt."""
    return isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(req.prompt[0], int)


def _tokenize(worker: PromptContext, raw: str | list[int], specials: bool) -> Prompt:
    processor, limit = worker.processor, worker.max_model_len
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
        before, after = processor.template.added_specials if specials else ([], [])
        if before or after:  # a text prompt has no media: its positions are the plain ones at any length
            ids = [*before, *prompt.input_ids, *after]
            return Prompt(ids, processor.family.delta(len(ids), [], processor.merge), [])
        return prompt
    vocab = processor.info.vocab_size
    if not raw:
        raise range_error("prompt", [], "that is a non-empty list of token ids")
    bad = next((t for t in raw if not 0 <= t < vocab or t == processor.info.image_token_id), None)
    if bad is not None:
        image = processor.info.image_token_id  # in range, so say why it is refused: "below 2048, got 2006" misleads
        raise range_error("prompt", bad, f"made of text token ids below {vocab}, not the image token {image}")
    return Prompt(raw, processor.family.delta(len(raw), [], processor.merge), [])


def _prompt_entries(req: CompletionRequest, ids: list[list[int]], n: int) -> int:
    """Log-prob entries the prompt side of the answer holds (docs/limits.md): every choice reports its prompt
    (n choices share one prompt; a batch has one choice per prompt)."""
    per_token = 0
    if req.echo:
        per_token += 1 + (1 + req.logprobs if req.logprobs is not None else 0)
    if req.prompt_logprobs is not None:
        per_token += 1 + req.prompt_logprobs
    return per_token * sum(len(i) for i in ids) * (n if len(ids) == 1 else 1)


def prepare_completion(
    worker: PromptContext, req: GenerateRequest, completion: CompletionRequest
) -> tuple[RequestAccepted, TokenizedRequest]:
    """Tokenize a completions prompt (or batch) and build what the frontend and the scheduler get."""
    processor = worker.processor
    # No media in a completions prompt, but its settings are checked as a chat's are (a 400 for a bad one).
    media_settings(completion.mm_processor_kwargs, processor.budgets, video=processor.video is not None,
                   pixel_cap=worker.config.max_image_pixels)
    raws = _prompts(completion)
    prompts = [_tokenize(worker, raw, completion.add_special_tokens) for raw in raws]
    ids = [p.input_ids for p in prompts]
    sampling = to_sampling_params(
        completion,
        max(len(i) for i in ids),  # the longest prompt of a batch bounds every choice's max_tokens
        worker.max_model_len,
        requested_max_tokens=completion.max_tokens,
        logprobs=completion.logprobs,
        defaults=worker.config.sampling_defaults,
        vocab_size=processor.info.vocab_size,
        prompt_param="prompt",
        validate=worker.structured.check,
    )
    # The prompt's log probabilities, with the most alternatives either answer shape asks for.
    echo_logprobs = completion.logprobs if completion.echo else None
    wanted = [k for k in (echo_logprobs, completion.prompt_logprobs) if k is not None]
    if wanted:
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=max(wanted))
    sampling = hold_to_budget(
        sampling, completion, worker.config.max_logprob_entries, _prompt_entries(completion, ids, sampling.n),
        "prompt_logprobs" if completion.prompt_logprobs is not None else "logprobs" if echo_logprobs is not None else "prompt",
        max(sampling.n, len(ids)),  # a batch: a choice per prompt
    )  # fmt: skip
    echoes = [(r if isinstance(r, str) else processor.decode(i)) if completion.echo else "" for r, i in zip(raws, ids, strict=True)]
    accepted = RequestAccepted(
        req.rid, completion.stream, completion.include_usage, completion.model, sum(len(i) for i in ids), worker.index,
        max(sampling.n, len(ids)), req.endpoint if req.endpoint in _OWN_ANSWERS else "completion", echoes[0],
        sampling.logprobs is not None,
        echoes if len(ids) > 1 else [], echo_logprobs, completion.prompt_logprobs, completion.continuous_usage,
        [len(i) for i in ids] if _batched(completion) else [],
        token_ids=bool(completion.return_token_ids), prompt_token_ids=ids if completion.return_token_ids else [],
    )
    return accepted, TokenizedRequest(req.rid, ids[0], prompts[0].mrope_delta, [], sampling, [], 0, more_prompts=ids[1:])
