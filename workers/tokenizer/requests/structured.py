"""Request fields that ask for structured output, and the ``StructuredSpec`` they become.

OpenAI's ``response_format`` (``json_object``, ``json_schema`` with ``strict``), vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice``, and vLLM's newer ``structured_outputs`` object. At most one may
be given; the engine (llguidance, workers/engine/runner/grammar.py) must be able to compile it, or the request is
refused with 400 naming the field and the reason.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Protocol

import msgspec

from ipc.prompts import StructuredSpec
from workers.common.errors import BadRequest


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # the grammar enforces the schema either way
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request object (the successor of its guided_* fields). A key it does not list
    is a 400 naming it: inside this object every key changes the answer, so none may be dropped unread."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's other keys: how its backends apply the spec. Only their defaults are served (structured_spec).
    structural_tag: Any = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # which backend compiles it, not what it allows: taken as sent


class StructuredFields(Protocol):
    """The request fields read here (declared on workers/sampling_request.SamplingFields)."""

    @property
    def response_format(self) -> ResponseFormat | None: ...
    @property
    def guided_json(self) -> dict[str, Any] | str | None: ...
    @property
    def guided_regex(self) -> str | None: ...
    @property
    def guided_choice(self) -> list[str] | None: ...
    @property
    def guided_grammar(self) -> str | None: ...
    @property
    def structured_outputs(self) -> StructuredOutputs | None: ...


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise BadRequest(f"'{param}' is not valid JSON: {exc}", param=param, code="invalid_value") from None
    # Sorted keys: the same schema is the same cache key for the compiled grammar, whatever the key order.
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _choice(choices: list[str], param: str) -> StructuredSpec:
    if not choices:
        raise BadRequest(f"'{param}' needs at least one choice.", param=param, code="invalid_value")
    return StructuredSpec("choice", json.dumps(choices))


def structured_spec(req: StructuredFields) -> tuple[StructuredSpec, str] | None:
    """The request's structured-output spec and the field it came from (None: free text)."""
    found: list[tuple[StructuredSpec, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append((StructuredSpec("json_object"), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise BadRequest(
                "'response_format' of type json_schema needs 'json_schema.schema'.",
                param="response_format.json_schema",
                code="invalid_value",
            )
        found.append((StructuredSpec("json_schema", _schema_text(fmt.json_schema.schema, "response_format")), "response_format"))
    if req.guided_json is not None:
        found.append((StructuredSpec("json_schema", _schema_text(req.guided_json, "guided_json")), "guided_json"))
    if req.guided_regex is not None:
        found.append((StructuredSpec("regex", req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((_choice(req.guided_choice, "guided_choice"), "guided_choice"))
    if req.guided_grammar is not None:
        found.append((StructuredSpec("lark", req.guided_grammar), "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        param = "structured_outputs"
        for key, sent in (("structural_tag", so.structural_tag is not None),
                          ("disable_any_whitespace", so.disable_any_whitespace),
                          ("disable_additional_properties", so.disable_additional_properties),
                          ("whitespace_pattern", so.whitespace_pattern is not None)):
            if sent:
                raise BadRequest(f"'{param}.{key}' is not supported: only the json, regex, choice, grammar and "
                                 "json_object specs are served, as written", param=f"{param}.{key}",
                                 code="unsupported_parameter")
        if so.json is not None:
            found.append((StructuredSpec("json_schema", _schema_text(so.json, param + ".json")), param))
        if so.regex is not None:
            found.append((StructuredSpec("regex", so.regex), param))
        if so.choice is not None:
            found.append((_choice(so.choice, param + ".choice"), param))
        if so.grammar is not None:
            found.append((StructuredSpec("lark", so.grammar), param))
        if so.json_object:
            found.append((StructuredSpec("json_object"), param))
    if len(found) > 1:
        names = ", ".join(sorted({param for _, param in found}))
        raise BadRequest(
            f"Only one kind of structured output per request; got several ({names}).",
            param=found[1][1],
            code="invalid_value",
        )
    return found[0] if found else None
