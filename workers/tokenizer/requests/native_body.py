"""The top level of another server's native request body (SGLang's /generate, vLLM's /inference/v1/generate):
decoded as a plain JSON object, where each field is read, or served only at values that change nothing, or refused
with a 400 naming it (nothing is dropped unread)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from workers.common.errors import BadRequest
from workers.tokenizer.requests.sampling import unsupported

_object = msgspec.json.Decoder(dict[str, Any])


class BodyFieldRefused(BadRequest):
    """A refusal of one of the body's own top-level fields, named as the body names it: the endpoints that rename
    the refusals of the completions request a body became (``sglang_names``, ``vllm_names``) leave it as it is, so a
    misplaced top-level ``max_tokens`` is not reported as ``sampling_params.max_tokens``."""


def refused_as_sent(exc: BadRequest) -> BodyFieldRefused:
    """``exc`` as a refusal of the body's own field, exempt from the renaming of a request the body became."""
    return BodyFieldRefused(exc.message, status=exc.status, param=exc.param, code=exc.code, type=exc.type)


@dataclass(frozen=True)
class BodyFields:
    taken: frozenset[str]  # fields the endpoint reads, whatever their value
    defaults: dict[str, tuple[Any, ...]]  # fields served only at one of these values (type included: 0 is not False)
    why: dict[str, str]  # why each of ``defaults`` is refused at another value
    kind: str  # what the body is, for the refusal of a field it does not know ("a /generate field")


def top_level(body: bytes | memoryview, fields: BodyFields) -> dict[str, Any]:
    """``body``'s top-level fields, each checked against ``fields`` (raises BadRequest)."""
    try:
        decoded = _object.decode(body)
    except msgspec.ValidationError:
        raise BadRequest("The request body must be a JSON object.", code="invalid_json") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    for name, value in decoded.items():
        if name in fields.defaults:
            if not any(value == d and type(value) is type(d) for d in fields.defaults[name]):
                raise refused_as_sent(unsupported(name, fields.why[name]))
        elif name not in fields.taken:
            raise refused_as_sent(unsupported(name, f"not {fields.kind} this server serves"))
    return decoded
