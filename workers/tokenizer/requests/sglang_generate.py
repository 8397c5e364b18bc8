"""SGLang's native ``POST /generate`` body, served as the completions request it amounts to: a raw prompt (``text``,
or token ids in ``input_ids``; one or a batch) and ``sampling_params`` in SGLang's names. It is what
``python -m sglang.bench_serving`` sends with its default backend (``sglang``), so that client measures glimpse
without a flag of its own.

With ``image_data`` the body is served as a chat request whose prompt is the client's own text (``RawPromptChat``,
workers/tokenizer/requests/image_data.py, which /v1/completions shares): the text holds one image placeholder per
image, in order, as the model's chat template writes them, which is what bench_serving's image datasets send.

Every field either maps onto a request field or is refused with a 400 naming it (``sampling_params.<key>`` for the
sampling keys). A refusal is reported under the /generate name of the field (``sglang_names``).

``return_logprob`` asks for SGLang's log probabilities (what lm-eval's ``sglang-generate`` model scores a
loglikelihood with): each generated token's (``logprobs`` of the completions request, ``top_logprobs_num`` best),
and with ``logprob_start_len`` >= 0 the prompt's from that position (``echo`` with logprobs: every prompt position is
computed). ``GenerateLogprobs`` carries what the answer's shape needs beyond that (server/generate_answer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from workers.common.errors import BadRequest
from workers.tokenizer.requests.completion import CompletionRequest, parse_completion
from workers.tokenizer.requests.image_data import (
    RawPromptChat,
    image_param,
    image_urls,
    raw_prompt_chat,
    renamed,
)
from workers.tokenizer.requests.native_body import BodyFieldRefused, BodyFields, top_level
from workers.tokenizer.requests.sampling import MAX_TOP_LOGPROBS, range_error, unsupported

# SGLang's SamplingParams default: a body without max_new_tokens generates at most this many tokens, as there.
DEFAULT_MAX_NEW_TOKENS = 128

# sampling_params key -> the completions field it sets (same meaning; SGLang's top_k -1 is the completions one).
_SAMPLING: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "n": "n",
    "sampling_seed": "seed",
    "logit_bias": "logit_bias",
}
# sampling_params key -> the structured_outputs key of the completions request.
_STRUCTURED = {"json_schema": "json", "regex": "regex"}
_WHY_NOT = {
    "ebnf": "EBNF grammars are not served; send a Lark grammar as structured_outputs.grammar on /v1/completions",
    "stop_regex": "stop patterns are not served (stop takes strings)",
    "custom_params": "custom logit processors are not served",
}

# Top-level fields that change nothing here when left at these values (SGLang's defaults; bench_serving sends
# lora_path None, return_logprob False and logprob_start_len -1 with every request).
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "lora_path": (None, ""),
    "lora_id": (None, ""),
    "video_data": (None, [], ""),
    "audio_data": (None, [], ""),
    "input_embeds": (None,),
    "session_params": (None,),
    "custom_logit_processor": (None,),
    "return_hidden_states": (None, False),
    "token_ids_logprob": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "priority": (None, 0),
}
_WHY_REFUSED = {
    "lora_path": "LoRA adapters are not served",
    "lora_id": "LoRA adapters are not served",
    "video_data": "videos are served on /v1/chat/completions (video_url parts)",
    "audio_data": "audio is not served",
    "input_embeds": "prompt embeddings are not served",
    "session_params": "sessions are not served",
    "custom_logit_processor": "custom logit processors are not served",
    "return_hidden_states": "hidden states are not returned",
    "token_ids_logprob": "log probabilities of chosen token ids are not served (top_logprobs_num gives the best)",
    "priority": "priority scheduling is not served (requests are served in arrival order)",
}
for _name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
    _WHY_REFUSED[_name] = "prefill/decode disaggregation is not served"
# Top-level fields taken and not passed on: they shape nothing of the answer (``rid`` is the client's own name for
# the request, meta_info.id is this server's).
_IGNORED = frozenset({"rid", "log_metrics", "modalities", "data_parallel_rank", "stream_output", "text_only"})
_LOGPROB_FIELDS = frozenset({"return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"})
_TAKEN = frozenset({"text", "input_ids", "sampling_params", "stream", "model", "image_data"}) | _LOGPROB_FIELDS
_FIELDS = BodyFields(_TAKEN | _IGNORED, _DEFAULTS, _WHY_REFUSED, "a /generate field")


@dataclass(frozen=True)
class GenerateLogprobs:
    """What ``return_logprob`` asks of the answer beyond the completions request's logprobs: where the prompt's
    entries start (None: none, SGLang's ``logprob_start_len`` -1) and whether entries carry the token's text."""

    start: int | None
    text: bool


def parse_generate(
    body: bytes | memoryview, served_model: str
) -> tuple[CompletionRequest | RawPromptChat, GenerateLogprobs | None]:
    """The request a /generate body amounts to: a completions request, or with images a ``RawPromptChat``, and what
    its answer reports of log probabilities (None: not asked for). Raises BadRequest; ``sglang_names`` gives its
    param the body's field name."""
    fields = top_level(body, _FIELDS)
    completion: dict[str, Any] = {"model": fields.get("model") or served_model, "prompt": _prompt(fields),
                                  "stream": fields.get("stream", False)}  # fmt: skip
    sampling, structured = _sampling(fields.get("sampling_params"), completion["prompt"])
    completion.update(sampling)
    if structured:
        completion["structured_outputs"] = structured
    completion.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    logprobs = _logprobs(fields, completion)
    images = image_urls(fields.get("image_data"))
    if not images:
        return parse_completion(msgspec.json.encode(completion)), logprobs
    if logprobs is not None:
        raise unsupported("return_logprob", "with image_data, log probabilities are not served")
    text = completion.pop("prompt")
    if not isinstance(text, str):
        raise unsupported("input_ids" if fields.get("text") is None else "text",
                          "with image_data, send one prompt as text (its image placeholders are expanded here)")
    return raw_prompt_chat(completion, text, images), None


def _logprobs(fields: dict[str, Any], completion: dict[str, Any]) -> GenerateLogprobs | None:
    """With ``return_logprob``, the completions fields it sets (``completion`` is updated) and what else the answer
    needs; its companions are read only then, as SGLang reads them."""
    asked = fields.get("return_logprob")
    if asked is None or asked is False:
        return None
    if asked is not True:
        raise range_error("return_logprob", asked, "that is a boolean")
    k, start, text = (fields.get(name) for name in ("top_logprobs_num", "logprob_start_len", "return_text_in_logprobs"))
    k = 0 if k is None else k
    if type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise range_error("top_logprobs_num", k, f"between 0 and {MAX_TOP_LOGPROBS}")
    start = -1 if start is None else start
    if type(start) is not int or start < -1:
        raise range_error("logprob_start_len", start, "that is -1 (no prompt positions) or a prompt position >= 0")
    if text is not None and type(text) is not bool:
        raise range_error("return_text_in_logprobs", text, "that is a boolean")
    completion["logprobs"] = k
    if start >= 0:  # echo with logprobs: the prompt's positions are computed, k best each
        completion["echo"] = True
    return GenerateLogprobs(start if start >= 0 else None, bool(text))


def _prompt(fields: dict[str, Any]) -> str | list[Any]:
    text, ids = fields.get("text"), fields.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("Send exactly one of 'text' and 'input_ids'.", param="text", code="invalid_value")
    if text is not None:
        if isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text)):
            return text
        raise range_error("text", text, "that is a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and (all(isinstance(t, int) for t in ids) or all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in ids)):  # fmt: skip
        return ids
    raise range_error("input_ids", "a list of that shape", "that is a list of token ids or a list of such lists")


def _sampling(params: Any, prompt: str | list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The completions fields and structured_outputs keys ``sampling_params`` sets. A batch may send one dict per
    prompt; they must be equal here (each sequence of a completions batch shares the request's sampling)."""
    if isinstance(params, list):
        count = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        if len(params) != count or any(p != params[0] for p in params):
            raise unsupported("sampling_params", "one dict for the whole batch (or equal dicts, one a prompt)")
        params = params[0]
    if params is None:
        return {}, {}
    if not isinstance(params, dict):
        raise range_error("sampling_params", params, "that is an object")
    sampling: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    for key, value in params.items():
        if key in _SAMPLING:
            if value is not None:
                sampling[_SAMPLING[key]] = value
        elif key in _STRUCTURED:
            if value is not None:
                structured[_STRUCTURED[key]] = value
        else:
            why = _WHY_NOT.get(key, "not a sampling parameter this server serves")
            raise unsupported(f"sampling_params.{key}", why)
    return sampling, structured


# completions field -> the /generate field it came from, for the refusals of the request a body became.
_SGLANG_NAME = {v: f"sampling_params.{k}" for k, v in _SAMPLING.items()} | {
    f"structured_outputs.{v}": f"sampling_params.{k}" for k, v in _STRUCTURED.items()
} | {"structured_outputs": "sampling_params", "logprobs": "return_logprob", "echo": "logprob_start_len"}
_top = msgspec.json.Decoder(dict[str, msgspec.Raw])


def sglang_names(exc: BadRequest, body: bytes | memoryview) -> BadRequest:
    """A refusal of the request a /generate ``body`` became (parsing, tokenizing, the sampling checks), with its
    param in /generate's names, and the message's where it quotes the param."""
    param = exc.param
    if param is None or isinstance(exc, BodyFieldRefused):
        return exc
    head, _, rest = param.partition("[")
    if head == "messages":  # a body with images, as its chat request: the text is part 0, image k part k + 1
        name = image_param(param, exc.code, "text")
    elif head == "prompt":
        try:
            ids = _top.decode(body).get("input_ids")
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            ids = None
        name = ("text" if ids is None or bytes(ids) == b"null" else "input_ids") + (f"[{rest}" if rest else "")
    else:
        name = _SGLANG_NAME.get(param, _SGLANG_NAME.get(head, param))
    return renamed(exc, name)
