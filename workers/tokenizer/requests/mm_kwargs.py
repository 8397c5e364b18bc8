"""A request's settings for its images' processing: vLLM's ``mm_processor_kwargs`` (chat and completions) and OpenAI's
per-image ``image_url.detail``.

Gemma 4 gives each image a budget of soft tokens (``max_soft_tokens``: 70, 140, 280, 560 or 1120, default the
checkpoint processor's). A request sets it for all its images with ``mm_processor_kwargs: {"max_soft_tokens": N}``;
an image part's ``detail`` overrides it for that image: "low" is the smallest budget, "high" the largest, "auto" (or
none) the request's. Families without budgets keep OpenAI's meaning of "low" (the image scaled down to 512 px on its
longer side before the processor sees it). A key the checkpoint's processor does not take, and any value it would
refuse, is a 400 naming it: never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workers.common.errors import BadRequest
from workers.tokenizer.requests.sampling import unsupported

FIELD = "mm_processor_kwargs"
BUDGET = "max_soft_tokens"


def request_budget(kwargs: Mapping[str, Any] | None, budgets: Sequence[int]) -> int | None:
    """The image token budget ``mm_processor_kwargs`` asks for (None: the checkpoint's default), checked against the
    family's ``budgets`` (empty: the family takes none). Raises BadRequest naming the key at fault."""
    for key in kwargs or {}:
        if key != BUDGET or not budgets:
            why = (
                "this model's images take no token budget" if key == BUDGET
                else "this server's image processing takes no such setting"
            )
            raise unsupported(f"{FIELD}.{key}", why)
    if not kwargs:
        return None
    value = kwargs[BUDGET]
    if isinstance(value, bool) or not isinstance(value, int) or value not in budgets:
        param = f"{FIELD}.{BUDGET}"
        allowed = ", ".join(str(b) for b in budgets)
        raise BadRequest(
            f"Invalid value for '{param}': expected one of {allowed}, but got {value!r} instead.",
            param=param,
            code="invalid_value",
        )
    return value


def image_options(detail: str | None, budget: int | None, budgets: Sequence[int]) -> tuple[bool, int | None]:
    """(scaled down before the processor, token budget) of one image with this ``detail``, in a request whose budget
    is ``budget`` (`request_budget`), for a family with these ``budgets`` (empty: none)."""
    if not budgets:
        return detail == "low", None
    if detail == "low":
        return False, min(budgets)
    if detail == "high":
        return False, max(budgets)
    return False, budget
