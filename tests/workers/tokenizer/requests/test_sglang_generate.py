"""SGLang's /generate body as the completions request it amounts to (workers/tokenizer/requests/sglang_generate.py):
each sampling key lands on its completions field, and what is not served is a 400 in /generate's own names."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from workers.common.errors import BadRequest
from workers.tokenizer.requests.chat import ImagePart, TextPart
from workers.tokenizer.requests.completion import CompletionRequest
from workers.tokenizer.requests.image_data import RawPromptChat
from workers.tokenizer.requests.sglang_generate import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateLogprobs,
    parse_generate,
    sglang_names,
)


def parse(**body: Any) -> CompletionRequest:
    req, logprobs = parse_generate(json.dumps(body).encode(), "served")
    assert isinstance(req, CompletionRequest) and logprobs is None
    return req


def refused(**body: Any) -> str | None:
    """The param of the 400 a body gets, in /generate's names (as the tokenizer worker reports it)."""
    raw = json.dumps(body).encode()
    with pytest.raises(BadRequest) as err:
        parse_generate(raw, "served")
    assert err.value.status == 400
    return sglang_names(err.value, raw).param


def test_bench_serving_body_maps_onto_completions() -> None:
    req = parse(text="Hello", sampling_params={"temperature": 0.0, "max_new_tokens": 7, "ignore_eos": True},
                stream=True, lora_path=None, return_logprob=False, logprob_start_len=-1, rid="r1")
    assert (req.prompt, req.max_tokens, req.temperature, req.ignore_eos, req.stream) == ("Hello", 7, 0.0, True, True)
    assert req.model == "served"


def test_every_sampling_key_lands_on_its_field() -> None:
    params = {"min_new_tokens": 2, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "frequency_penalty": 0.2,
              "presence_penalty": 0.3, "repetition_penalty": 1.1, "stop": ["x"], "stop_token_ids": [5], "n": 2,
              "sampling_seed": 9, "skip_special_tokens": True, "json_schema": '{"type": "object"}'}
    req = parse(input_ids=[1, 2, 3], sampling_params=params)
    assert req.prompt == [1, 2, 3] and req.max_tokens == DEFAULT_MAX_NEW_TOKENS
    assert (req.min_tokens, req.top_p, req.top_k, req.min_p) == (2, 0.5, 3, 0.1)
    assert (req.frequency_penalty, req.presence_penalty, req.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (req.stop, req.stop_token_ids, req.n, req.seed) == (["x"], [5], 2, 9)
    assert req.structured_outputs is not None and req.structured_outputs.json == '{"type": "object"}'
    batch = parse(text=["a", "b"], sampling_params=[{"top_k": 1}, {"top_k": 1}])
    assert batch.prompt == ["a", "b"] and batch.top_k == 1


def test_return_logprob_asks_for_the_tokens_and_from_logprob_start_len_the_prompt() -> None:
    def asked(**body: Any) -> tuple[CompletionRequest, GenerateLogprobs | None]:
        req, logprobs = parse_generate(json.dumps({"input_ids": [[1, 2, 3]], **body}).encode(), "served")
        assert isinstance(req, CompletionRequest)
        return req, logprobs

    # lm-eval's sglang-generate loglikelihood body: the prompt's logprobs from position 0, the best one each.
    req, logprobs = asked(sampling_params={"max_new_tokens": 1, "temperature": 0}, logprob_start_len=0,
                          top_logprobs_num=1, return_logprob=True)
    assert (req.logprobs, req.echo, req.max_tokens) == (1, True, 1)
    assert logprobs == GenerateLogprobs(0, False)
    # SGLang's defaults: the generated tokens' alone (logprob_start_len -1), no alternatives, no texts.
    req, logprobs = asked(return_logprob=True)
    assert (req.logprobs, req.echo) == (0, False) and logprobs == GenerateLogprobs(None, False)
    req, logprobs = asked(return_logprob=True, logprob_start_len=2, top_logprobs_num=5, return_text_in_logprobs=True)
    assert (req.logprobs, req.echo) == (5, True) and logprobs == GenerateLogprobs(2, True)
    # Without return_logprob its companions change nothing (bench_serving sends logprob_start_len -1 always).
    req, logprobs = asked(return_logprob=False, logprob_start_len=0, top_logprobs_num=3)
    assert (req.logprobs, req.echo, logprobs) == (None, False, None)
    # The prompt alone: max_new_tokens 0 is served with the prompt's logprobs.
    req, _ = asked(return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 0})
    assert req.max_tokens == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": "a", "input_ids": [1]}, "text"),
        ({}, "text"),
        ({"text": 5}, "text"),
        ({"input_ids": [[1], 2]}, "input_ids"),
        ({"text": "a", "image_data": [5]}, "image_data"),
        ({"text": ["a", "b"], "image_data": "data:image/png;base64,AAAA"}, "text"),
        ({"input_ids": [1, 2], "image_data": "data:image/png;base64,AAAA"}, "input_ids"),
        ({"text": "a", "image_data": "AAAA", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "image_data": "AAAA", "return_logprob": True}, "return_logprob"),
        ({"text": "a", "return_logprob": 0}, "return_logprob"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 1.5}, "top_logprobs_num"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "return_logprob": True, "return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
        ({"text": "a", "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ({"text": "a", "lora_path": "x"}, "lora_path"),
        ({"text": "a", "session_params": {"id": "s"}}, "session_params"),
        ({"text": "a", "made_up": 1}, "made_up"),
        # Misplaced top-level fields that are also completions fields: named as sent, not as sampling_params.* or
        # the text (the names the completions request's own refusals get).
        ({"text": "a", "max_tokens": 5}, "max_tokens"),
        ({"text": "a", "temperature": 0}, "temperature"),
        ({"text": "a", "prompt": "b"}, "prompt"),
        ({"text": "a", "messages": []}, "messages"),
        ({"text": "a", "sampling_params": {"ebnf": "root ::= x"}}, "sampling_params.ebnf"),
        ({"text": "a", "sampling_params": {"made_up": 1}}, "sampling_params.made_up"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
        ({"text": "a", "sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
        ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}]}, "sampling_params"),
        ({"text": ["a", "b"], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ],
)
def test_what_is_not_served_is_named(body: dict[str, Any], param: str) -> None:
    assert refused(**body) == param


def test_images_make_a_chat_request_that_keeps_the_text() -> None:
    text = "<|vision_start|><|image_pad|><|vision_end|>Read it."
    req, _ = parse_generate(json.dumps({"text": text, "image_data": ["data:image/png;base64,QUFB", "QkJC", "/srv/a.png"],
                                        "sampling_params": {"temperature": 0}, "stream": True}).encode(), "served")
    assert isinstance(req, RawPromptChat) and req.raw_prompt == text and req.stream and req.temperature == 0
    assert req.max_tokens == DEFAULT_MAX_NEW_TOKENS
    [message] = req.messages
    assert isinstance(message.content, list) and isinstance(message.content[0], TextPart)
    urls = [p.url for p in message.content[1:] if isinstance(p, ImagePart)]
    assert urls == ["data:image/png;base64,QUFB", "data:image/png;base64,QkJC", "file:///srv/a.png"]
    # Bare base64 of a JPEG starts with "/9j/": the image itself, not a path (which then was refused as a file URL);
    # wrapped lines too. Schemes are read whatever their case, as the chat endpoint reads them.
    jpeg = base64.encodebytes(b"\xff\xd8\xff\xe0" + bytes(range(60))).decode()
    upper = "DATA:image/png;base64,QUFB"
    req, _ = parse_generate(json.dumps({"text": text * 3, "image_data": [jpeg, upper, "/srv/img-1"]}).encode(), "served")
    assert isinstance(req, RawPromptChat) and isinstance(req.messages[0].content, list)
    urls = [p.url for p in req.messages[0].content[1:] if isinstance(p, ImagePart)]
    assert jpeg.startswith("/9j/") and urls == ["data:image/png;base64," + jpeg, upper, "file:///srv/img-1"]
    # Its chat request's params, named as the body names them.
    image = BadRequest("Could not fetch", param="messages[0].content[2].image_url")
    assert sglang_names(image, b"{}").param == "image_data[1]"
    assert sglang_names(BadRequest("x", param="messages[0].content[0].text"), b"{}").param == "text"
    assert sglang_names(BadRequest("x", param="messages", code="too_many_images"), b"{}").param == "image_data"


def test_refusals_are_renamed() -> None:
    text, ids = b'{"text": "a"}', b'{"input_ids": [1], "text": null}'
    exc = BadRequest("Invalid 'prompt': too long", param="prompt", code="context_length_exceeded")
    assert sglang_names(exc, text).param == "text" and sglang_names(exc, ids).param == "input_ids"
    assert sglang_names(exc, ids).message == "Invalid 'input_ids': too long"
    limit = BadRequest("Invalid 'max_tokens'", param="max_tokens")
    assert sglang_names(limit, text).param == "sampling_params.max_new_tokens"
    assert sglang_names(BadRequest("busy", status=503), text).param is None
