"""vLLM's tokens-in, tokens-out ``POST /inference/v1/generate`` body (its ``GenerateRequest``: what the render routes,
/v1/chat/completions/render and /v1/completions/render, answer), served as the completions request of its token
ids. With the render routes it closes llm-d's loop of rendering in one place and generating from token ids in
another; AIPerf's ``vllm_generate`` endpoint sends the same body.

``sampling_params`` are vLLM's ``SamplingParams`` fields, the completions endpoint's names (the render routes write
them so); ``logit_bias`` may come as an object or as the render's [id, bias] pairs. Served only as a whole answer of
text-token prompts: ``stream``, ``features`` (a prompt with images, whose pixels this body does not carry),
log probabilities, ``kv_transfer_params`` and ``cache_salt`` are refused with a 400 naming them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from workers.common.errors import BadRequest
from workers.tokenizer.requests.completion import CompletionRequest, parse_completion
from workers.tokenizer.requests.native_body import BodyFieldRefused, BodyFields, top_level
from workers.tokenizer.requests.sampling import range_error, unsupported

_WHY_REFUSED = {
    "stream": "this endpoint answers whole (stream on /v1/completions)",
    "features": "a prompt with images or videos is served on /v1/chat/completions, which carries their pixels",
    "kv_transfer_params": "KV transfer between servers is not served",
    "cache_salt": "prefix-cache salts are not served",
    "priority": "priority scheduling is not served (requests are served in arrival order)",
}
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "features": (None,),
    "kv_transfer_params": (None,),
    "cache_salt": (None,),
    "priority": (None, 0),
}
_TAKEN = frozenset({"token_ids", "sampling_params", "model", "request_id"})
# SamplingParams fields that say how vLLM hands outputs back, not what is generated: taken at these values.
_OUTPUT_FORM: dict[str, tuple[Any, ...]] = {"output_kind": (None, 0, 2), "detokenize": (None, True)}
# Fields of the completions request that a sampling_params dict may set (the request-level ones excluded).
_SAMPLING = frozenset(CompletionRequest.__struct_fields__) - {"model", "prompt", "stream", "stream_options", "echo",
                                                              "suffix", "user", "mm_processor_kwargs"}  # fmt: skip
_LOGPROBS = frozenset({"logprobs", "prompt_logprobs"})
# vLLM's SamplingParams default: a GenerateRequest without max_tokens generates at most this many tokens, as there.
DEFAULT_MAX_TOKENS = 16

_FIELDS = BodyFields(_TAKEN, _DEFAULTS, _WHY_REFUSED, "a GenerateRequest field")


def parse_vllm_generate(body: bytes | memoryview, served_model: str) -> CompletionRequest:
    """The completions request a GenerateRequest amounts to (raises BadRequest naming the body's field)."""
    fields = top_level(body, _FIELDS)
    ids = fields.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise range_error("token_ids", "a value of that shape", "that is a non-empty list of token ids")
    completion: dict[str, Any] = {"model": fields.get("model") or served_model, "prompt": ids}
    params = fields.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        raise range_error("sampling_params", params, "that is an object")
    for key, value in (params or {}).items():
        if key in _OUTPUT_FORM:
            if not any(value == d for d in _OUTPUT_FORM[key]):
                raise unsupported(f"sampling_params.{key}", "outputs are handed back whole, detokenized")
        elif key in _LOGPROBS and value is not None:
            raise unsupported(f"sampling_params.{key}", "log probabilities are served on /v1/completions")
        elif key not in _SAMPLING:
            raise unsupported(f"sampling_params.{key}", "not a sampling parameter this server serves")
        elif value is not None:
            completion[key] = _bias(value) if key == "logit_bias" else value
    completion.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return parse_completion(msgspec.json.encode(completion))


def _bias(value: Any) -> Any:
    """``logit_bias`` as the completions request takes it: the render writes [id, bias] pairs, vLLM an object."""
    if isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        return {str(token): bias for token, bias in value}
    return value


def vllm_names(exc: BadRequest) -> BadRequest:
    """A refusal of the completions request a GenerateRequest became, in the body's names (the prompt is
    ``token_ids``, the sampling fields sit in ``sampling_params``); other params are the body's own already."""
    param = exc.param
    head = (param or "").partition("[")[0].partition(".")[0]
    if param is None or isinstance(exc, BodyFieldRefused) or (head != "prompt" and head not in _SAMPLING):
        return exc
    rest = param.removeprefix("prompt")
    name = f"token_ids{rest}" if head == "prompt" else f"sampling_params.{param}"
    message = exc.message.replace(f"'{param}'", f"'{name}'")
    return BadRequest(message, status=exc.status, param=name, code=exc.code, type=exc.type)
