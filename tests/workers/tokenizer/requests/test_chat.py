"""Chat-completions request parsing: OpenAI-shaped errors for bad bodies, faithful parsing of good ones."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipc.prompts import SamplingParams
from workers.common.errors import BadRequest
from workers.tokenizer.requests.chat import (
    ImagePart,
    TextPart,
    image_refs,
    parse_request,
    to_sampling_params,
)
from workers.tokenizer.requests.chat_prompt import template_messages
from workers.tokenizer.requests.structured import structured_spec

USER = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


BAD: list[tuple[str, bytes, int, str | None, str | None]] = [
    # (case, body, status, param, code)
    ("malformed json", b'{"model": "m", "messages": [', 400, None, "invalid_json"),
    ("empty body", b"", 400, None, "invalid_json"),
    ("not an object", b"[1, 2]", 400, None, "invalid_value"),
    ("missing model", json.dumps({"messages": USER}).encode(), 400, "model", "missing_required_parameter"),
    ("messages not a list", body(messages="hello"), 400, "messages", "invalid_value"),
    ("messages empty", body(messages=[]), 400, "messages", "invalid_value"),
    (
        "unknown role",
        body(messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "unknown part type",
        body(messages=[{"role": "user", "content": [{"type": "input_file", "input_file": {}}]}]),
        400,
        "messages[0].content[0].type",
        "invalid_value",
    ),
    (
        "text part without text",
        body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
        "missing_required_parameter",
    ),
    (
        "image_url of the wrong type",
        body(messages=[USER[0], {"role": "user", "content": [{"type": "image_url", "image_url": 7}]}]),
        400,
        "messages[1].content[0].image_url",
        "invalid_value",
    ),
    ("temperature wrong type", body(temperature="hot"), 400, "temperature", "invalid_value"),
    ("temperature 3", body(temperature=3), 400, "temperature", "invalid_value"),
    ("temperature negative", body(temperature=-0.1), 400, "temperature", "invalid_value"),
    ("top_p 0", body(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p above 1", body(top_p=1.5), 400, "top_p", "invalid_value"),
    ("top_k -2", body(top_k=-2), 400, "top_k", "invalid_value"),
    ("max_tokens 0", body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (
        "max_completion_tokens -1",
        body(max_completion_tokens=-1),
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    ("too many stops", body(stop=[str(i) for i in range(17)]), 400, "stop", "invalid_value"),
    ("empty stop", body(stop=""), 400, "stop", "invalid_value"),
    ("n 0", body(n=0), 400, "n", "invalid_value"),
    ("n 17", body(n=17), 400, "n", "invalid_value"),
    ("presence_penalty 2.5", body(presence_penalty=2.5), 400, "presence_penalty", "invalid_value"),
    ("frequency_penalty -3", body(frequency_penalty=-3), 400, "frequency_penalty", "invalid_value"),
    ("repetition_penalty 0", body(repetition_penalty=0), 400, "repetition_penalty", "invalid_value"),
    ("min_p 1.5", body(min_p=1.5), 400, "min_p", "invalid_value"),
    ("min_tokens above max", body(min_tokens=9, max_tokens=4), 400, "min_tokens", "invalid_value"),
    ("top_logprobs 21", body(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    ("top_logprobs alone", body(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("tools without function", body(tools=[{"type": "function"}]), 400, "tools", "invalid_value"),
    ("tool_choice without tools", body(tool_choice="required"), 400, "tool_choice", "invalid_value"),
    ("legacy functions", body(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    ("stream not a bool", body(stream="yes"), 400, "stream", "invalid_value"),
]


@pytest.mark.parametrize(("case", "data", "status", "param", "code"), BAD, ids=[c[0] for c in BAD])
def test_bad_bodies(case: str, data: bytes, status: int, param: str | None, code: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(data)
    err = info.value
    assert (err.status, err.param, err.code, err.type) == (status, param, code, "invalid_request_error")
    assert err.message and "`" not in err.message
    failed = err.to_failed("r1")
    assert (failed.rid, failed.status, failed.param, failed.code) == ("r1", status, param, code)


def test_string_content_and_defaults() -> None:
    req = parse_request(body())
    assert req.model == "m" and req.messages[0].content == "hi"
    assert not req.stream and not req.include_usage
    assert template_messages(req) == [{"role": "user", "content": "hi"}]
    assert image_refs(req) == []
    assert to_sampling_params(req, prompt_len=10, max_model_len=100) == SamplingParams(max_tokens=90)


def test_parts_both_image_url_forms_and_unknown_fields_ignored() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "name": "ignored",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
                {"type": "image_url", "image_url": "https://example.com/a.png"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    req = parse_request(body(messages=messages, some_sdk_extra={"x": 1}, user="u1"))
    parts = req.messages[1].content
    assert isinstance(parts, list)
    assert (
        isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart) and isinstance(parts[2], ImagePart)
    )
    refs = image_refs(req)
    assert [r.url for r in refs] == ["data:image/png;base64,AAAA", "https://example.com/a.png"]
    assert [r.param for r in refs] == ["messages[1].content[1].image_url", "messages[1].content[2].image_url"]
    assert template_messages(req) == [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "compare"}, {"type": "image_url"}, {"type": "image_url"}],
        },
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(("stop", "expected"), [("END", ("END",)), (["a", "bb"], ("a", "bb")), (None, ())])
def test_stop_as_string_or_list(stop: str | list[str] | None, expected: tuple[str, ...]) -> None:
    req = parse_request(body(stop=stop))
    assert to_sampling_params(req, 1, 10).stop == expected


def test_sampling_params_mapping() -> None:
    req = parse_request(
        body(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=50,
            max_completion_tokens=20,
            temperature=0,
            top_p=0.5,
            top_k=-1,
            seed=7,
            n=1,
            presence_penalty=0,
            stop_token_ids=[5],
            ignore_eos=True,
        )
    )
    assert req.stream and req.include_usage
    sp = to_sampling_params(req, prompt_len=100, max_model_len=1000)
    # max_completion_tokens wins over the deprecated max_tokens; top_k -1 means off (0).
    assert sp == SamplingParams(
        max_tokens=20, temperature=0.0, top_p=0.5, top_k=0, seed=7, stop_token_ids=(5,), ignore_eos=True
    )
    assert sp.greedy
    # stream_options only means something when streaming: refused without stream (as OpenAI and vLLM do)
    with pytest.raises(BadRequest) as info:
        parse_request(body(stream_options={"include_usage": True}))
    assert info.value.param == "stream_options"


def test_context_length() -> None:
    req = parse_request(body(max_tokens=500))
    assert to_sampling_params(req, prompt_len=900, max_model_len=1000).max_tokens == 100  # clamped
    assert to_sampling_params(req, prompt_len=999, max_model_len=1000).max_tokens == 1
    for prompt_len in (1000, 5000):
        with pytest.raises(BadRequest) as info:
            to_sampling_params(req, prompt_len=prompt_len, max_model_len=1000)
        assert (info.value.status, info.value.code, info.value.param) == (
            400,
            "context_length_exceeded",
            "messages",
        )
        assert str(prompt_len) in info.value.message


def test_new_sampling_fields_map_to_sampling_params() -> None:
    req = parse_request(
        body(
            presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3, min_p=0.1, min_tokens=3,
            logit_bias={"7": 2.5, "11": -100}, logprobs=True, top_logprobs=4,
        )
    )
    sp = to_sampling_params(req, prompt_len=10, max_model_len=100, vocab_size=50)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.3)
    assert (sp.min_p, sp.min_tokens, sp.logprobs) == (0.1, 3, 4)
    assert sp.logit_bias == ((7, 2.5), (11, -100.0))
    assert to_sampling_params(parse_request(body(logprobs=True)), 10, 100).logprobs == 0
    assert to_sampling_params(parse_request(body(logprobs=False)), 10, 100).logprobs is None
    for bias in ({"x": 1}, {"50": 1}, {"3": 101}):
        with pytest.raises(BadRequest) as info:
            to_sampling_params(parse_request(body(logit_bias=bias)), 10, 100, vocab_size=50)
        assert info.value.param == "logit_bias"


def test_generation_config_fills_only_what_the_request_leaves_out() -> None:
    defaults = {"temperature": 0.1, "top_p": 0.001, "top_k": 1.0, "repetition_penalty": 1.05, "max_tokens": 30}
    sp = to_sampling_params(parse_request(body()), 10, 100, defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.1, 0.001, 1, 1.05, 30)
    sp = to_sampling_params(parse_request(body(temperature=0.7, top_k=-1, max_tokens=5)), 10, 100, defaults)
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.repetition_penalty) == (0.7, 0, 5, 1.05)


# vLLM's and OpenAI's fields that would change the answer and are not served: each is a 400 naming it unless it
# is sent at its default (what clients that fill every field send).
UNSERVED: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    # (sent, the same field at its default, the param the error names)
    ({"use_beam_search": True}, {"use_beam_search": False}, "use_beam_search"),
    ({"length_penalty": 2.0}, {"length_penalty": 1.0}, "length_penalty"),
    ({"bad_words": ["no"]}, {"bad_words": []}, "bad_words"),
    ({"allowed_token_ids": [5, 6]}, {"allowed_token_ids": None}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 5}, {"truncate_prompt_tokens": None}, "truncate_prompt_tokens"),
    ({"spaces_between_special_tokens": False}, {"spaces_between_special_tokens": True}, "spaces_between_special_tokens"),
    ({"return_tokens_as_token_ids": True}, {"return_tokens_as_token_ids": False}, "return_tokens_as_token_ids"),
    ({"cache_salt": "tenant-a"}, {"cache_salt": None}, "cache_salt"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, {"kv_transfer_params": None}, "kv_transfer_params"),
    ({"logits_processors": ["my.Processor"]}, {"logits_processors": []}, "logits_processors"),
    ({"max_repetition_pattern_size": 8}, {"max_repetition_pattern_size": 0}, "max_repetition_pattern_size"),
    ({"repetition_min_count": 3}, {"repetition_min_count": 0}, "repetition_min_count"),
    ({"priority": -1}, {"priority": 0}, "priority"),
    ({"structured_outputs": {"structural_tag": "{}"}}, {"structured_outputs": {"regex": "a+"}},
     "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     {"structured_outputs": {"regex": "a+", "disable_fallback": True}}, "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a+", "not_a_key": 1}}, {"structured_outputs": {"json_object": True}},
     "structured_outputs"),
]
CHAT_ONLY: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    ({"best_of": 3}, {"best_of": 1}, "best_of"),
    ({"prompt_logprobs": 1}, {"prompt_logprobs": None}, "prompt_logprobs"),
    ({"chat_template": "{{ 'X' }}"}, {"chat_template": None}, "chat_template"),
    ({"add_special_tokens": True}, {"add_special_tokens": False}, "add_special_tokens"),
    ({"media_io_kwargs": {"video": {"num_frames": 8}}}, {"media_io_kwargs": {}}, "media_io_kwargs"),
]


@pytest.mark.parametrize(("sent", "default", "param"), UNSERVED + CHAT_ONLY, ids=[c[2] for c in UNSERVED + CHAT_ONLY])
def test_unserved_fields_are_refused_naming_them_and_their_defaults_pass(
    sent: dict[str, Any], default: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        structured_spec(parse_request(body(**sent)))  # the structured-output spec is read after parsing
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    structured_spec(parse_request(body(**default)))


@pytest.mark.parametrize(("sent", "default", "param"), UNSERVED, ids=[c[2] for c in UNSERVED])
def test_completions_refuse_the_same_fields(sent: dict[str, Any], default: dict[str, Any], param: str) -> None:
    from workers.tokenizer.requests.completion import parse_completion

    prompt = {"model": "m", "prompt": "hi"}
    with pytest.raises(BadRequest) as info:
        structured_spec(parse_completion(json.dumps({**prompt, **sent}).encode()))
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    structured_spec(parse_completion(json.dumps({**prompt, **default}).encode()))


def test_reasoning_effort_goes_to_a_template_that_reads_it_and_is_refused_by_one_that_does_not() -> None:
    from workers.tokenizer.requests.chat_prompt import template_options

    req = parse_request(body(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}))
    options = template_options(req, lambda name: name == "reasoning_effort")
    assert options["reasoning_effort"] == "low" and options["enable_thinking"] is False
    with pytest.raises(BadRequest) as info:
        template_options(req, lambda name: False)
    assert (info.value.param, info.value.code) == ("reasoning_effort", "unsupported_parameter")
    assert "reasoning_effort" not in template_options(parse_request(body()), lambda name: False)


def test_documents_go_to_a_template_that_renders_them_and_are_refused_by_one_that_does_not() -> None:
    from workers.tokenizer.requests.chat_prompt import template_options

    docs = [{"title": "Invoice", "text": "Total 42."}]
    req = parse_request(body(documents=docs))
    assert template_options(req, lambda name: name == "documents")["documents"] == docs
    with pytest.raises(BadRequest) as info:
        template_options(req, lambda name: False)
    assert (info.value.param, info.value.code) == ("documents", "unsupported_parameter")
