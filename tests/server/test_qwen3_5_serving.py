"""Qwen3.5 dense and MoE (hybrid linear attention) served end to end: `glimpse serve --tp 2` over gloo, real processes,
the official openai client. Five images equal transformers' greedy answer; a four-turn chat that resends every earlier
image matches transformers on every turn, encodes each image once and resumes every later turn from a state
snapshot (/admin/stats' state_pool). With --reasoning-parser qwen3, a thinking prompt's answer is reasoning, streamed or
not, on chat and on the Responses API, counted in usage's reasoning_tokens; a continued assistant message that opened <think> goes on inside the
reasoning, one that closed it as content; a thinking_token_budget forces </think> after that many reasoning tokens,
as transformers' greedy loop with the same rule; and a grammar cannot constrain it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from PIL import Image

from tests.reference import ChatReference, HFReference, greedy_text
from tests.server.live import LiveServer, data_url, png_bytes

MAX_NEW = 12
ODD = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]
FIVE = [png_bytes(w, h, seed=90 + i) for i, (w, h) in enumerate(ODD)]
PAGES = [png_bytes(w, h, seed=190 + i) for i, (w, h) in enumerate(ODD[:4])]  # images no other test sends


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[LiveServer, Path]]:
    model_dir: Path = request.getfixturevalue("qwen3_5_moe_model_dir" if request.param == "moe" else "qwen3_5_model_dir")
    server = LiveServer(model_dir, "--tp", "2", "--tokenizer-workers", "1", "--chunk-size", "64",
                        "--reasoning-parser", "qwen3")
    yield server, model_dir
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def test_five_images_over_tp2_equal_transformers(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    text = "Compare these five pages."
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in FIVE]
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],  # type: ignore[list-item]
        max_tokens=MAX_NEW, temperature=0,
    )
    assert resp.choices[0].message.content == greedy_text(model_dir, FIVE, text, MAX_NEW)


def test_four_turn_chat_resends_its_images_and_resumes_from_state_snapshots(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    reference = ChatReference(model_dir, MAX_NEW)
    client = server.client(timeout=120)
    sent: list[dict[str, Any]] = []  # what the client sends (data URLs)
    local: list[dict[str, Any]] = []  # the same chat for transformers (PIL images)
    start = server.stats()
    previous = 0
    for turn in range(4):
        image = PAGES[turn]
        text = f"Page {turn}: what changed?"
        sent.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": text}]})
        local.append({"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")},
                                                  {"type": "text", "text": text}]})
        resp = client.chat.completions.create(model="demo", messages=sent, max_tokens=MAX_NEW, temperature=0)  # type: ignore[arg-type]
        answer = resp.choices[0].message.content or ""
        assert answer == reference.answer(local), turn
        server.stats_when("images_encoded", start["images_encoded"] + turn + 1)
        stats = server.stats_when("restores", start["state_pool"]["restores"] + turn)
        assert stats["state_pool"]["restores"] - start["state_pool"]["restores"] == turn  # every turn after the first
        assert stats["images_encoded"] - start["images_encoded"] == turn + 1  # each image once
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        if turn:  # all of the turn before's prompt but its last partial block (16-token blocks on the CPU)
            assert previous - 16 <= (resp.usage.prompt_tokens_details.cached_tokens or 0) < previous
        previous = resp.usage.prompt_tokens
        sent.append({"role": "assistant", "content": answer})
        local.append({"role": "assistant", "content": answer})


def test_a_thinking_prompt_answers_in_reasoning_streamed_or_not(served: tuple[LiveServer, Path]) -> None:
    server, _ = served
    client = server.client(timeout=120)
    messages: Any = [{"role": "user", "content": "Think it over: what is in a lighthouse?"}]
    thinking: Any = {"chat_template_kwargs": {"enable_thinking": True}}
    answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                            extra_body=thinking)
    whole = answer.choices[0]
    # The template opened <think>; a random model never closes it within 12 tokens: all of it is reasoning, and so
    # are all of its tokens.
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == answer.usage.completion_tokens == MAX_NEW
    reasoning = getattr(whole.message, "reasoning_content", None)
    assert reasoning and getattr(whole.message, "reasoning", None) == reasoning
    assert whole.message.content is None and whole.finish_reason == "length"
    streamed, content, streamed_usage = "", "", None
    for chunk in client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                                extra_body=thinking, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            streamed += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
        streamed_usage = chunk.usage or streamed_usage
    assert (streamed, content) == (reasoning, "")
    assert streamed_usage is not None and streamed_usage.completion_tokens_details is not None
    assert streamed_usage.completion_tokens_details.reasoning_tokens == MAX_NEW
    # vLLM's include_reasoning false: the same tokens, their reasoning left out of the answer (still counted).
    hidden = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                            extra_body={**thinking, "include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None and not hidden.choices[0].message.content
    assert hidden.usage is not None and hidden.usage.completion_tokens_details is not None
    assert hidden.usage.completion_tokens_details.reasoning_tokens == MAX_NEW
    # The Responses API: the same reasoning as a reasoning item (no message: there is no content), streamed as
    # reasoning_text deltas.
    response = client.responses.create(model="demo", input=messages, max_output_tokens=MAX_NEW, temperature=0,
                                       extra_body=thinking)
    assert [o.type for o in response.output] == ["reasoning"] and response.output[0].content[0].text == reasoning
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == MAX_NEW
    events = list(client.responses.create(model="demo", input=messages, max_output_tokens=MAX_NEW, temperature=0,
                                          extra_body=thinking, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    # Thinking off: the template closes an empty reasoning; the answer is content, with no reasoning field.
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    # Continuing an assistant message that opened <think> and did not close it: inside, all reasoning; one that
    # closed it: the answer goes on as content.
    for prefix, inside in (("<think>\nLet me see", True), ("<think>\nEasy.\n</think>\n\nIt is", False)):
        more = client.chat.completions.create(
            model="demo", messages=[*messages, {"role": "assistant", "content": prefix}], max_tokens=MAX_NEW,
            temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False},
        ).choices[0].message
        assert bool(getattr(more, "reasoning_content", None)) is inside and bool(more.content) is not inside, prefix
    # A grammar would constrain the reasoning: refused, naming the field.
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_NEW, extra_body=thinking,
                                       response_format={"type": "json_object"})
    assert refused.value.status_code == 400 and "response_format" in str(refused.value)


def test_a_thinking_budget_forces_the_end_of_the_reasoning(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    ref = HFReference(model_dir)
    messages: Any = [{"role": "user", "content": "Think it over: what is in a lighthouse?"}]
    end = ref.tokenizer.convert_tokens_to_ids("</think>")
    budget = 3

    def force(logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
        # The template opened <think>: the first `budget` tokens think, then </think> unless the model wrote it.
        if end in out or len(out) < budget:
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[end] = 0.0
        return forced

    expected, _ = ref.greedy(ref.prompt_ids(messages, enable_thinking=True), MAX_NEW, force)
    assert expected[budget] == end
    answer = server.client(timeout=120).chat.completions.create(
        model="demo", messages=messages, max_tokens=MAX_NEW, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget,
                    "return_token_ids": True})  # fmt: skip
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert getattr(choice.message, "reasoning_content", None) == ref.text(expected[:budget]).strip()
    assert choice.message.content == ref.text(expected[budget + 1:]).strip()
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == budget + 1  # the marker counts as reasoning
    # Anthropic's thinking budget is the same bound.
    message = httpx.post(server.base + "/v1/messages", timeout=120, json={
        "model": "demo", "max_tokens": MAX_NEW, "temperature": 0, "messages": messages,
        "thinking": {"type": "enabled", "budget_tokens": budget}}).json()
    assert [b["type"] for b in message["content"]] == ["thinking", "text"], message
    assert message["content"][0]["thinking"] == ref.text(expected[:budget]).strip()
    assert message["content"][1]["text"] == ref.text(expected[budget + 1:]).strip()
