"""Structured outputs through the real server and the official openai client. The demo model has random
weights, so an answer that parses and validates proves the grammar, not the model: every test samples at
temperature 1 under several seeds."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.live import LiveServer

# An extraction schema in OpenAI's strict form. Strings and arrays are bounded: a random model inside a
# free string would only stop when it happens to sample a quote.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 16},
        "invoice_no": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "total": {"type": "number", "minimum": 0, "maximum": 100000},
        "items": {"type": "integer", "minimum": 1, "maximum": 50},
        "paid": {"type": "boolean"},
        "status": {"type": "string", "enum": ["draft", "sent", "paid", "void"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"], "maxLength": 10},
    },
    "required": ["vendor", "invoice_no", "total", "items", "paid", "status", "tags", "address", "note"],
    "additionalProperties": False,
}
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Extract the invoice fields as JSON."}]
SEEDS = [0, 1, 2, 3]


def json_schema_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "invoice", "schema": SCHEMA, "strict": True}}


def chat(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "messages": MESSAGES, "max_tokens": 300, "temperature": 1.0, **fields}
    return server.client().chat.completions.create(**args)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_answers_validate_streamed_and_not(live: LiveServer, seed: int) -> None:
    whole = chat(live, response_format=json_schema_format(), seed=seed)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"  # the grammar ended the answer, not max_tokens
    streamed = "".join(
        c.choices[0].delta.content or "" for c in chat(live, response_format=json_schema_format(), seed=seed, stream=True)
        if c.choices
    )
    assert streamed == text


def test_free_text_under_the_same_seed_is_not_json(live: LiveServer) -> None:
    text = chat(live, seed=0, max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_json_object_and_vllm_guided_fields(live: LiveServer, seed: int) -> None:
    obj = json.loads(chat(live, response_format={"type": "json_object"}, seed=seed).choices[0].message.content)
    assert isinstance(obj, dict)
    guided = chat(live, seed=seed, extra_body={"guided_json": SCHEMA}).choices[0].message.content
    jsonschema.validate(json.loads(guided), SCHEMA)
    code = chat(live, seed=seed, extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"}).choices[0].message.content
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", code)
    pick = chat(live, seed=seed, extra_body={"guided_choice": ["approve", "reject", "escalate"]}).choices[0].message.content
    assert pick in ("approve", "reject", "escalate")
    newer = chat(live, seed=seed, extra_body={"structured_outputs": {"choice": ["left", "right"]}}).choices[0].message.content
    assert newer in ("left", "right")


def test_every_choice_of_n_follows_the_schema(live: LiveServer) -> None:
    resp = chat(live, response_format=json_schema_format(), seed=9, n=3)
    answers = [json.loads(c.message.content) for c in resp.choices]
    for answer in answers:
        jsonschema.validate(answer, SCHEMA)
    assert len({json.dumps(a) for a in answers}) > 1


def test_completions_take_the_same_fields(live: LiveServer) -> None:
    resp = live.client().completions.create(
        model="demo", prompt="Invoice number:", max_tokens=20, temperature=1.0, seed=3,
        extra_body={"guided_regex": "INV-[0-9]{4}"},
    )
    assert re.fullmatch("INV-[0-9]{4}", resp.choices[0].text)


@pytest.mark.parametrize(
    ("fields", "param", "reason"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}, "response_format", "nope"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "unclosed character class"),
        ({"extra_body": {"guided_json": SCHEMA, "guided_choice": ["a"]}}, "guided_choice", "one kind"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema", "schema"),
    ],
    ids=["bad-type", "dangling-ref", "bad-regex", "two-kinds", "no-schema"],
)
def test_specs_the_engine_cannot_compile_get_400_with_the_reason(
    live: LiveServer, fields: dict[str, Any], param: str, reason: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(live, **fields)
    body: Any = info.value.body
    assert body["param"] == param and reason in body["message"]
