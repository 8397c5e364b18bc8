"""Sampling fields shared by /v1/chat/completions and /v1/completions: their struct, their checks, the
checkpoint's generation_config.json defaults, and the ``SamplingParams`` they become.

A field the request leaves out (or sends as null) takes the checkpoint's default where
generation_config.json has one (``--generation-config auto``, as vLLM does: Qwen ships near-greedy
settings with a repetition penalty), else glimpse's own default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from ipc.prompts import SamplingParams, StructuredSpec
from workers.common.errors import BadRequest
from workers.tokenizer.requests.structured import ResponseFormat, StructuredOutputs, structured_spec

# Checks a structured-output spec (raising BadRequest naming the field); the tokenizer passes llguidance's.
Validate = Callable[[StructuredSpec, str], None]

MAX_STOP_STRINGS = 16  # OpenAI allows 4; stop strings are cheap for us, so allow a few more
# Characters of one stop string: every step of a choice checks its new text against each stop's prefixes, a
# cost that grows with the square of a stop's length (workers/common/detokenizer.py StopChecker).
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices of one request: each is a sequence of its own in the batch
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300

log = logging.getLogger("glimpse.sampling")

# generation_config.json keys vLLM takes as defaults, and the request field each one fills.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (GuideLLM sends it)


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """Request fields both endpoints take. null is what several SDKs send for "default", so every knob
    takes None."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM-style extension: 0 or -1 disable it
    min_p: float | None = None  # vLLM-style extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM-style extension
    ignore_eos: bool = False  # vLLM-style extension, for benchmarks
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM-style extension
    min_tokens: int | None = None  # vLLM-style extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's detokenizing switches: only their defaults are served (anything else is a 400 naming it).
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (workers/tokenizer/requests/structured.py): OpenAI's, then vLLM's extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark syntax (llguidance's)
    structured_outputs: StructuredOutputs | None = None
    # vLLM's sampling and detokenizing extensions that are not served: refused with a 400 naming them unless left at
    # their defaults (check_sampling), since each would change the answer.
    use_beam_search: bool = False
    length_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None  # a tenant's prefix-cache isolation: dropped unread, a client would think it had it
    thinking_token_budget: int | None = None  # vLLM's bound on a reasoning model's thinking tokens
    kv_transfer_params: Any = None  # vLLM's prefill/decode hand-off (what llm-d's P/D sidecar sends)
    logits_processors: Any = None  # vLLM's server-side logits processors, by qualified name
    # vLLM's repetition detection: a repeated token pattern ends the answer
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0
    priority: int = 0  # vLLM's priority scheduling (any other value is an error there without it)
    # vLLM's: the answer also names the prompt's token ids and each choice's (per chunk when streamed).
    return_token_ids: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n


def range_error(param: str, value: object, expected: str) -> BadRequest:
    return BadRequest(
        f"Invalid '{param}': expected a value {expected}, but got {value!r} instead.",
        param=param,
        code="invalid_value",
    )


def unsupported(param: str, why: str) -> BadRequest:
    return BadRequest(f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")


def refuse_sent(fields: Iterable[tuple[str, bool, str]]) -> None:
    """(param, sent, why) for fields served only at their defaults: the first one sent otherwise is a 400 naming it."""
    for param, sent, why in fields:
        if sent:
            raise unsupported(param, why)


def check_sampling(req: SamplingFields, max_tokens: int | None) -> None:
    """Value checks msgspec's types cannot express, in parameter order, first failure wins."""
    if not req.skip_special_tokens:
        raise unsupported("skip_special_tokens", "answers are always decoded without special tokens")
    if req.include_stop_str_in_output:
        raise unsupported("include_stop_str_in_output", "a stop string is never part of the answer")
    refuse_sent((
        ("use_beam_search", req.use_beam_search, "beam search is not served (n samples choices)"),
        ("length_penalty", req.length_penalty not in (None, 1.0), "it scores beams, and beam search is not served"),
        ("bad_words", bool(req.bad_words), "banned words are not served (logit_bias bans single tokens)"),
        ("allowed_token_ids", req.allowed_token_ids is not None,
         "restrict the answer with logit_bias or a structured output instead"),
        ("truncate_prompt_tokens", req.truncate_prompt_tokens is not None,
         "prompts are never cut; one past the context length is refused"),
        ("spaces_between_special_tokens", not req.spaces_between_special_tokens,
         "answers are decoded without special tokens"),
        ("return_tokens_as_token_ids", bool(req.return_tokens_as_token_ids), "logprobs name tokens by their text"),
        ("cache_salt", req.cache_salt is not None, "prefix-cache salts are not served"),
        ("kv_transfer_params", req.kv_transfer_params is not None,
         "prefill/decode disaggregation is not served (each server prefills and decodes its requests)"),
        ("logits_processors", bool(req.logits_processors), "custom logits processors are not served"),
        *((name, bool(getattr(req, name)), "repetition detection is not served (repetition_penalty and "
           "frequency_penalty discourage repeats)")
          for name in ("max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count")),
        ("priority", req.priority != 0, "requests are scheduled in arrival order"),
    ))
    if req.thinking_token_budget is not None and req.thinking_token_budget < 0:
        raise range_error("thinking_token_budget", req.thinking_token_budget, ">= 0")
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM answer it: it would change nothing
        raise BadRequest("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                         param="stream_options", code="invalid_value")
    if req.seed is not None and not -(2**63) <= req.seed <= 2**64 - 1:  # torch's seed range
        raise range_error("seed", req.seed, "between -2**63 and 2**64 - 1")
    for name in ("top_k", "min_tokens"):  # past 64 bits no message could carry them
        if (value := getattr(req, name)) is not None and value >= 2**63:
            raise range_error(name, value, "below 2**63")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise range_error("temperature", req.temperature, "between 0 and 2")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise range_error("top_p", req.top_p, "in (0, 1]")
    if req.top_k is not None and req.top_k < -1:
        raise range_error("top_k", req.top_k, ">= -1 (-1 or 0 disable top-k)")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise range_error("min_p", req.min_p, "between 0 and 1")
    stops = req.stop_strings
    if len(stops) > MAX_STOP_STRINGS:
        raise range_error("stop", f"{len(stops)} strings", f"of at most {MAX_STOP_STRINGS} strings")
    if any(not s for s in stops):
        raise range_error("stop", "", "that is a non-empty string")
    if (longest := max((len(s) for s in stops), default=0)) > MAX_STOP_CHARS:
        raise range_error("stop", f"a string of {longest} characters", f"of at most {MAX_STOP_CHARS} characters")
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise range_error("n", req.n, f"between 1 and {MAX_N}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise range_error(name, value, "between -2 and 2")
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= 2.0:
        raise range_error("repetition_penalty", req.repetition_penalty, "in (0, 2]")
    if req.min_tokens is not None:
        if req.min_tokens < 0:
            raise range_error("min_tokens", req.min_tokens, ">= 0")
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise range_error("min_tokens", req.min_tokens, f"<= max_tokens ({max_tokens})")
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise range_error("logit_bias", f"{len(req.logit_bias)} entries", f"of at most {MAX_LOGIT_BIAS} entries")


def hold_to_budget(
    sampling: SamplingParams,
    req: SamplingFields,
    budget: int,
    prompt_entries: int = 0,
    prompt_param: str = "messages",
    choices: int = 0,
) -> SamplingParams:
    """Hold one answer to ``budget`` log-prob entries (``--max-logprob-entries``, docs/limits.md), checked before
    any model work: what the scheduler and the frontend hold of an answer, and the JSON it becomes, stay bounded.

    ``prompt_entries``: what the prompt side asks for over every choice (echoed tokens, their logprobs, vLLM's
    prompt_logprobs); past the budget a 400 names ``prompt_param``. A generated token of an answer that is not
    streamed costs 1 per choice (``choices``, default n), 1 + k more with logprobs; streamed, it is written as it
    comes and held nowhere. A max_tokens the client sent that does not fit is a 400 naming it; one left to the
    server (the context's room, or generation_config's) is lowered to fit instead."""
    if prompt_entries > budget:
        raise BadRequest(
            f"This request asks for {prompt_entries:,} log-probability entries for its prompt tokens (per choice and "
            f"token: 1 echoed, 1 + k with logprobs, 1 + k with prompt_logprobs); this server answers at most "
            f"{budget:,} per request. Send fewer or shorter prompts, or ask for fewer alternatives.",
            param=prompt_param,
            code="logprob_budget_exceeded",
        )
    if req.stream:
        return sampling
    choices = choices or sampling.n
    per_token = choices * (1 + (1 + sampling.logprobs if sampling.logprobs is not None else 0))
    fit = (budget - prompt_entries) // per_token
    if sampling.max_tokens <= fit:
        return sampling
    sent = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    if fit < 1 or getattr(req, sent) is not None:
        with_logprobs = f" with logprobs (1 + 1 + {sampling.logprobs})" if sampling.logprobs is not None else " (1)"
        raise BadRequest(
            f"'{sent}' of {sampling.max_tokens} asks for {prompt_entries + sampling.max_tokens * per_token:,} "
            f"log-probability entries in a whole answer: {choices} choice(s) x {sampling.max_tokens} tokens"
            f"{with_logprobs} per token{', and the prompt' if prompt_entries else ''}; this server answers at most "
            f"{budget:,} per request. Ask for at most {max(fit, 0)} tokens, fewer choices or alternatives, or stream.",
            param=sent,
            code="logprob_budget_exceeded",
        )
    return msgspec.structs.replace(sampling, max_tokens=fit)


def _token_ids(param: str, ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    bad = next((t for t in ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise range_error(param, bad, f"made of token ids below {vocab_size}")
    return tuple(ids or ())


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    out = []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise range_error("logit_bias", key, "keyed by token ids") from None
        if not 0 <= token < vocab_size:
            raise range_error("logit_bias", token, f"keyed by token ids below {vocab_size}")
        if not -100.0 <= value <= 100.0:
            raise range_error("logit_bias", value, "between -100 and 100")
        out.append((token, float(value)))
    return tuple(out)


def load_generation_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling defaults of a checkpoint's generation_config.json (empty if it has none), keyed by
    request field. Read once by the launcher; tokenizers get the result inside ServerConfig."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, float] = {}
    for key, field in _GENERATION_KEYS.items():
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[field] = float(value)
    return out


def to_sampling_params(
    req: SamplingFields,
    prompt_len: int,
    max_model_len: int,
    *,
    requested_max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, float] = {},  # noqa: B006 - read only
    vocab_size: int = 1 << 31,
    prompt_param: str = "messages",
    validate: Validate | None = None,
    structured: tuple[StructuredSpec, str] | None = None,
) -> SamplingParams:
    """Sampling settings for a prompt of ``prompt_len`` tokens.

    A prompt that leaves no room for one new token is refused (context_length_exceeded); otherwise
    max_tokens defaults to, and is clamped to, the room left in the context window, so a client
    asking for "as much as possible" with a large max_tokens still gets an answer.
    """
    if prompt_len >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_param} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {prompt_param} or images.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - prompt_len

    def pick(name: str, value: float | None, fallback: float) -> float:
        if value is not None:
            return float(value)
        return defaults.get(name, fallback)

    requested = requested_max_tokens
    if requested is None and "max_tokens" in defaults:
        requested = int(defaults["max_tokens"])
    top_k = int(pick("top_k", req.top_k, 0))
    found = structured_spec(req)
    if structured is not None:  # a grammar of the endpoint's own (tool_choice)
        if found is not None:
            message = f"'{found[1]}' and '{structured[1]}' both constrain the answer; send one of them."
            raise BadRequest(message, param=found[1], code="invalid_value")
        found = structured
    if found is not None and validate is not None:
        validate(*found)
    return SamplingParams(
        max_tokens=room if requested is None else min(requested, room),
        temperature=pick("temperature", req.temperature, 1.0),
        top_p=pick("top_p", req.top_p, 1.0),
        top_k=top_k if top_k > 0 else 0,
        seed=req.seed,
        stop=req.stop_strings,
        stop_token_ids=_token_ids("stop_token_ids", req.stop_token_ids, vocab_size),
        ignore_eos=req.ignore_eos,
        presence_penalty=float(req.presence_penalty or 0.0),
        frequency_penalty=float(req.frequency_penalty or 0.0),
        repetition_penalty=pick("repetition_penalty", req.repetition_penalty, 1.0),
        min_p=pick("min_p", req.min_p, 0.0),
        min_tokens=req.min_tokens or 0,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        logprobs=logprobs,
        n=req.choices,
        structured=found[0] if found is not None else None,
    )
