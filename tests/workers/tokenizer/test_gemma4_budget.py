"""Per-request image token budgets (Gemma 4's ``max_soft_tokens``) and audio parts, from the request body to the
tokenizer's answer: ``mm_processor_kwargs`` checked against the family's budgets (a 400 naming the key otherwise),
``image_url.detail`` mapped to the smallest / largest budget for Gemma 4 only, one image at two budgets two images
to the caches, audio parts refused by name."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc.control import RequestFailed
from ipc.prompts import TokenizedRequest
from ipc.requests import GenerateRequest
from ipc.shm import ShmSegment
from tests.workers.tokenizer.harness import MODEL, png, server_config
from workers.common.errors import BadRequest
from workers.engine.prompt.processor import MMProcessor
from workers.tokenizer.requests.chat import image_refs, parse_request
from workers.tokenizer.requests.completion import parse_completion
from workers.tokenizer.requests.mm_kwargs import image_options, request_budget
from workers.tokenizer.worker import TokenizerWorker

GEMMA = (70, 140, 280, 560, 1120)


def image_part(raw: bytes, detail: str | None = None) -> dict[str, Any]:
    url: dict[str, Any] = {"url": f"data:image/png;base64,{base64.b64encode(raw).decode()}"}
    if detail is not None:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}


def chat(parts: list[dict[str, Any]], **extra: Any) -> bytes:
    content = [{"type": "text", "text": "What is on the page?"}, *parts]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                       **extra}).encode()


def completion(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "A page", "max_tokens": 4, **extra}).encode()


def handle(worker: TokenizerWorker, body: bytes, endpoint: str = "chat") -> TokenizedRequest:
    """The request as the scheduler gets it; its segments unlinked (the scheduler's job) once read."""
    result = worker.handle(GenerateRequest("r", memoryview(body), 0.0, endpoint))
    assert isinstance(result, tuple), result
    for name in result[1].shm_names:
        ShmSegment.unlink(name)
    return result[1]


def refusal(worker: TokenizerWorker, body: bytes, endpoint: str = "chat") -> tuple[int, str | None, str | None]:
    result = worker.handle(GenerateRequest("r", memoryview(body), 0.0, endpoint))
    assert isinstance(result, RequestFailed), result
    return result.status, result.code, result.param


# ---- the request's own checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", GEMMA)
def test_each_budget_is_taken(budget: int) -> None:
    assert request_budget({"max_soft_tokens": budget}, GEMMA) == budget


@pytest.mark.parametrize("value", [400, 0, -70, "280", 280.0, True, None, [280]])
def test_a_budget_gemma_does_not_take_is_a_400_naming_it(value: Any) -> None:
    with pytest.raises(BadRequest) as err:
        request_budget({"max_soft_tokens": value}, GEMMA)
    assert (err.value.status, err.value.param, err.value.code) == (
        400, "mm_processor_kwargs.max_soft_tokens", "invalid_value"
    )
    assert "70, 140, 280, 560, 1120" in err.value.message


@pytest.mark.parametrize(
    ("kwargs", "budgets", "param"),
    [
        ({"fps": 2}, GEMMA, "mm_processor_kwargs.fps"),  # a key no processor here takes
        ({"max_soft_tokens": 280, "fps": 2}, GEMMA, "mm_processor_kwargs.fps"),
        ({"max_soft_tokens": 280}, (), "mm_processor_kwargs.max_soft_tokens"),  # a family without budgets
    ],
)
def test_settings_the_processor_does_not_take_are_refused(
    kwargs: dict[str, Any], budgets: tuple[int, ...], param: str
) -> None:
    with pytest.raises(BadRequest) as err:
        request_budget(kwargs, budgets)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, "unsupported_parameter")


def test_no_settings_no_budget() -> None:
    assert request_budget(None, GEMMA) is None and request_budget({}, GEMMA) is None and request_budget({}, ()) is None


def test_detail_maps_to_budgets_for_gemma_only() -> None:
    body = chat([image_part(b"a", "low"), image_part(b"b", "high"), image_part(b"c", "auto"), image_part(b"d")],
                mm_processor_kwargs={"max_soft_tokens": 560})
    req = parse_request(body)
    gemma = [(r.low, r.budget) for r in image_refs(req, GEMMA)]
    assert gemma == [(False, 70), (False, 1120), (False, 560), (False, 560)]
    plain = parse_request(chat([image_part(b"a", "low"), image_part(b"b", "high"), image_part(b"d")]))
    assert [(r.low, r.budget) for r in image_refs(plain, ())] == [(True, None), (False, None), (False, None)]
    assert [(r.low, r.budget) for r in image_refs(plain, GEMMA)] == [(False, 70), (False, 1120), (False, None)]
    assert image_options(None, None, GEMMA) == (False, None)  # the checkpoint's default, decided by the processor
    with pytest.raises(BadRequest):  # checked even without a family's budgets at hand
        image_refs(parse_request(chat([], mm_processor_kwargs={"max_soft_tokens": 280})))


def test_mm_processor_kwargs_must_be_an_object() -> None:
    with pytest.raises(BadRequest) as err:
        parse_request(chat([], mm_processor_kwargs=[280]))
    assert err.value.param == "mm_processor_kwargs"
    with pytest.raises(BadRequest) as err:
        parse_completion(completion(mm_processor_kwargs="max_soft_tokens=280"))
    assert err.value.param == "mm_processor_kwargs"


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "input_audio"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "audio_url"),
    ],
)
def test_audio_parts_are_refused_by_name(part: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_request(chat([part]))
    assert (err.value.status, err.value.param) == (400, f"messages[0].content[1].{param}")
    assert "audio input is not supported" in err.value.message


# ---- through the tokenizer worker ---------------------------------------------------------------------------------


def test_families_without_budgets_refuse_them(demo_model_dir: Path, launch_id: str) -> None:
    worker = TokenizerWorker(server_config(demo_model_dir, launch_id), 0, logging.getLogger("test"))
    try:
        bad = {"mm_processor_kwargs": {"max_soft_tokens": 280}}
        named = (400, "unsupported_parameter", "mm_processor_kwargs.max_soft_tokens")
        assert refusal(worker, chat([], **bad)) == named
        assert refusal(worker, completion(**bad), "completion") == named
        assert len(handle(worker, completion(mm_processor_kwargs={}), "completion").input_ids) > 0
    finally:
        worker.close()


@pytest.fixture
def gemma_worker(gemma4_model_dir: Path, launch_id: str) -> Iterator[TokenizerWorker]:
    worker = TokenizerWorker(server_config(gemma4_model_dir, launch_id), 0, logging.getLogger("test"))
    yield worker
    worker.close()


def _tokens(processor: MMProcessor, size: tuple[int, int], budget: int | None) -> int:
    grid = processor.image_grid(*size, budget=budget)
    assert grid is not None
    return processor.tokens_for_grid(grid)


def test_gemma_budgets_reach_the_prompt(gemma_worker: TokenizerWorker) -> None:
    processor = gemma_worker.processor
    size = (320, 200)
    raw = png(*size, seed=3)
    default = handle(gemma_worker, chat([image_part(raw)]))
    small = handle(gemma_worker, chat([image_part(raw)], mm_processor_kwargs={"max_soft_tokens": 70}))
    named = handle(gemma_worker, chat([image_part(raw)], mm_processor_kwargs={"max_soft_tokens": 280}))
    parts = handle(gemma_worker, chat([image_part(raw, "low"), image_part(raw, "high"), image_part(raw)],
                                      mm_processor_kwargs={"max_soft_tokens": 140}))
    assert [i.length for i in default.items] == [_tokens(processor, size, None)] == [i.length for i in named.items]
    assert [i.length for i in small.items] == [_tokens(processor, size, 70)]
    assert [i.length for i in parts.items] == [_tokens(processor, size, b) for b in (70, 1120, 140)]
    # One image at another budget is another image to the caches; the default named or not is the same one.
    assert default.items[0].hash == named.items[0].hash == processor.media_hash(raw)
    assert small.items[0].hash == processor.media_hash(raw, 70) != default.items[0].hash
    assert len({i.hash for i in parts.items}) == 3
    assert parts.items[0].hash == small.items[0].hash
    # Each span sits between <|image> and <image|>, its resized uint8 frame written at its own grid (16-px patches,
    # 3 x 3 of them to a token).
    boi, eoi = processor.tokenizer.convert_tokens_to_ids(["<|image>", "<image|>"])
    for item in parts.items:
        assert parts.input_ids[item.offset - 1] == boi and parts.input_ids[item.offset + item.length] == eoi
        _, h, w = item.grid
        assert h * w == item.length * 9
        assert item.pixels is not None and item.pixels.dtype == "uint8" and item.pixels.shape == (h * 16, w * 16, 3)


def test_gemma_refusals(gemma_worker: TokenizerWorker) -> None:
    raw = png(200, 100, seed=4)
    bad = (400, "invalid_value", "mm_processor_kwargs.max_soft_tokens")
    assert refusal(gemma_worker, chat([image_part(raw)], mm_processor_kwargs={"max_soft_tokens": 300})) == bad
    assert refusal(gemma_worker, completion(mm_processor_kwargs={"max_soft_tokens": 71}), "completion") == bad
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    assert refusal(gemma_worker, chat([image_part(raw), audio])) == (
        400, "unsupported_parameter", "messages[0].content[2].input_audio"
    )
    ok = handle(gemma_worker, completion(mm_processor_kwargs={"max_soft_tokens": 1120}), "completion")
    assert len(ok.input_ids) > 0


def test_a_template_that_refuses_tools_is_named_by_its_refusal(gemma_worker: TokenizerWorker) -> None:
    """The demo's chat template renders no tools (it raises): the 400 names ``tools`` where the messages alone
    render, and ``messages`` where they are what it refuses (a tool result)."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    assert refusal(gemma_worker, chat([], tools=[tool])) == (400, None, "tools")
    result = gemma_worker.handle(GenerateRequest("r", memoryview(chat([], tools=[tool])), 0.0, "chat"))
    assert isinstance(result, RequestFailed) and "renders no tools" in result.message
    messages = [{"role": "user", "content": "Look it up."},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()
    assert refusal(gemma_worker, body) == (400, None, "messages")
    assert handle(gemma_worker, chat([])).input_ids  # the same worker serves a plain chat after both
