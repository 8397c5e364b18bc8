"""Gemma 4 served end to end: real processes, the official openai client; the dense demo over `--tp 2` (gloo), the MoE
demo on one rank. Five images equal transformers' greedy answer; a three-turn chat that resends every earlier image
(its context passes the 64-token sliding window many times) matches transformers on every turn, encodes each image
once and serves each turn's history from the prefix cache; per-request token budgets (``mm_processor_kwargs`` and
``detail``) equal transformers' processor at that budget; audio parts and bad budgets get a 400 naming the field.
Served with --reasoning-parser gemma4: answers without channel markers stay content, and answers forced through the
marker tokens split into reasoning and content by token, streamed or not, with reasoning_tokens in the usage."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from tests.reference import ChatReference, greedy_text
from tests.server.live import LiveServer, data_url, png_bytes

MAX_NEW = 12
ODD = [(57, 83), (300, 200), (123, 77), (640, 480), (29, 29)]
FIVE = [png_bytes(w, h, seed=290 + i) for i, (w, h) in enumerate(ODD)]
PAGES = [png_bytes(w, h, seed=390 + i) for i, (w, h) in enumerate(ODD[:3])]  # images no other test sends


@pytest.fixture(scope="module", params=["dense-tp2", "moe"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[LiveServer, Path]]:
    moe = request.param == "moe"
    model_dir: Path = request.getfixturevalue("gemma4_moe_model_dir" if moe else "gemma4_model_dir")
    tp = [] if moe else ["--tp", "2"]
    server = LiveServer(model_dir, *tp, "--tokenizer-workers", "1", "--chunk-size", "64", "--reasoning-parser", "gemma4")
    yield server, model_dir
    assert server.stop() == 0, server.output()
    assert server.segments() == []


def image_turn(image: bytes, text: str, detail: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """One user turn as the client sends it (a data URL) and as transformers takes it (a PIL image)."""
    url: dict[str, Any] = {"url": data_url(image)}
    if detail is not None:
        url["detail"] = detail
    sent = {"role": "user", "content": [{"type": "image_url", "image_url": url}, {"type": "text", "text": text}]}
    local = {"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")},
                                         {"type": "text", "text": text}]}
    return sent, local


def test_five_images_equal_transformers(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    text = "Compare these five pages."
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in FIVE]
    resp = server.client(timeout=120).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],  # type: ignore[list-item]
        max_tokens=MAX_NEW, temperature=0,
    )
    assert resp.choices[0].message.content == greedy_text(model_dir, FIVE, text, MAX_NEW)


def test_three_turn_chat_past_the_window_hits_the_prefix_cache(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    reference = ChatReference(model_dir, MAX_NEW)
    client = server.client(timeout=120)
    sent: list[dict[str, Any]] = []
    local: list[dict[str, Any]] = []
    start = server.stats()
    previous = 0
    for turn in range(3):
        mine, theirs = image_turn(PAGES[turn], f"Page {turn}: what changed?")
        sent.append(mine)
        local.append(theirs)
        resp = client.chat.completions.create(model="demo", messages=sent, max_tokens=MAX_NEW, temperature=0)  # type: ignore[arg-type]
        answer = resp.choices[0].message.content or ""
        assert answer == reference.answer(local), turn
        stats = server.stats_when("images_encoded", start["images_encoded"] + turn + 1)
        assert stats["images_encoded"] - start["images_encoded"] == turn + 1  # each image once
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        if turn:  # the turn before's prompt (and the blocks its answer filled) but the last partial block (16 on the CPU)
            cached = resp.usage.prompt_tokens_details.cached_tokens or 0
            assert previous - 16 <= cached < resp.usage.prompt_tokens, (turn, cached, previous)
        previous = resp.usage.prompt_tokens
        sent.append({"role": "assistant", "content": answer})
        local.append({"role": "assistant", "content": answer})
    assert previous > 4 * 64  # the last turn's context passed the sliding window four times over
    # The sliding layers keep their own pool (the smallest over the TP ranks): blocks left the window and went back.
    pool = server.stats()["window_blocks"]
    assert pool["total"] > 0 and pool["released"] > 0, pool


def test_token_budgets_per_request_and_per_image(served: tuple[LiveServer, Path]) -> None:
    server, model_dir = served
    reference = ChatReference(model_dir, MAX_NEW)
    client = server.client(timeout=120)
    image = png_bytes(640, 480, seed=77)
    sent, local = image_turn(image, "What is on this page?")
    usage: dict[int, int] = {}
    for budget in (70, 140):
        resp = client.chat.completions.create(
            model="demo", messages=[sent], max_tokens=MAX_NEW, temperature=0,  # type: ignore[list-item]
            extra_body={"mm_processor_kwargs": {"max_soft_tokens": budget}},
        )
        expected = reference.answer([local], processor_kwargs={"max_soft_tokens": budget})
        assert resp.choices[0].message.content == expected, budget
        assert resp.usage is not None
        usage[budget] = resp.usage.prompt_tokens
    assert usage[70] < usage[140]  # the image's span follows its budget
    low, _ = image_turn(image, "What is on this page?", detail="low")  # "low": the smallest budget, 70
    resp = client.chat.completions.create(model="demo", messages=[low], max_tokens=MAX_NEW, temperature=0)  # type: ignore[list-item]
    assert resp.usage is not None and resp.usage.prompt_tokens == usage[70]
    assert resp.choices[0].message.content == reference.answer([local], processor_kwargs={"max_soft_tokens": 70})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"mm_processor_kwargs": {"max_soft_tokens": 100}}, "mm_processor_kwargs.max_soft_tokens"),
        ({"mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs.fps"),
    ],
)
def test_bad_budgets_are_400s_naming_the_field(served: tuple[LiveServer, Path], extra: dict[str, Any], param: str) -> None:
    server, _ = served
    sent, _ = image_turn(PAGES[0], "Hi.")
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="demo", messages=[sent], max_tokens=4, extra_body=extra,  # type: ignore[list-item]
        )
    assert err.value.status_code == 400
    assert param in str(err.value.body)


def test_audio_parts_are_a_400_naming_the_field(served: tuple[LiveServer, Path]) -> None:
    server, _ = served
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(
            model="demo", messages=[{"role": "user", "content": [audio, {"type": "text", "text": "Hi."}]}],  # type: ignore[list-item]
            max_tokens=4,
        )
    assert "input_audio" in str(err.value.body)
    ok = server.client().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Still there?"}], max_tokens=2,
    )
    assert ok.choices[0].message.content is not None


def expected_split(tok: Any, ids: list[int], start: int, end: int) -> tuple[str, str, int]:
    """The split by its rule, from the whole id sequence: the decoded tokens between a start and an end marker are
    reasoning (the head of each part a marker began without its whitespace), the others content; reasoning tokens:
    the start markers, the tokens inside and the end markers that close a block."""
    parts: tuple[list[str], list[str]] = ([], [])
    inside, run, tokens = False, [], 0
    for token in [*ids, None]:
        if token in (start, end, None) and (token != end or inside):
            text = tok.decode(run, skip_special_tokens=True)
            parts[inside].append(text.lstrip() if parts[inside] or inside else text)
            tokens += len(run) if inside else 0
            inside, run = token == start, []
            tokens += token is not None
        else:
            run.append(token)
    return "".join(parts[True]), "".join(parts[False]), tokens


def test_reasoning_parser_splits_on_the_channel_marker_tokens(served: tuple[LiveServer, Path]) -> None:
    """The random-weight demo never writes the markers by itself; logit_bias +100 on both marker tokens and two words
    leaves greedy decoding a choice among those four only, and frequency_penalty turns it from one to the next (the
model's own logits order them, deterministically), so the answer opens and closes the channel around words. The
    sampled ids (from logprobs) show the answer went through both markers and words; the answer's reasoning, content
    and reasoning_tokens are what the split's rule makes of those ids, the same streamed as whole. A plain answer (no
    markers) is all content, with reasoning_tokens 0."""
    from transformers import AutoTokenizer

    server, model_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)
    start, end = tok.convert_tokens_to_ids(["<|channel>", "<channel|>"])
    words = [tok.encode(w, add_special_tokens=False)[-1] for w in (" the", " light")]
    bias = {str(t): 100 for t in (start, end, *words)}
    client = server.client(timeout=120)
    ask: Any = {"model": "demo", "messages": [{"role": "user", "content": "Think, then answer."}], "temperature": 0}
    forced: Any = {**ask, "max_tokens": 24, "logit_bias": bias, "frequency_penalty": 2}
    whole = client.chat.completions.create(**forced, logprobs=True)
    by_text = {tok.decode([t], skip_special_tokens=False): t for t in (start, end, *words)}
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    ids = [by_text[entry.token] for entry in whole.choices[0].logprobs.content]
    assert start in ids and end in ids[ids.index(start):] and set(words) & set(ids), ids  # what the test relies on
    reasoning, content, tokens = expected_split(tok, ids, start, end)
    message = whole.choices[0].message
    # content null when the answer is reasoning alone, as the reasoning split gives it
    assert (getattr(message, "reasoning_content", None), message.content) == (
        reasoning or None, content if content or not reasoning else None)
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == tokens
    streamed, text, usage = "", "", None
    for chunk in client.chat.completions.create(**forced, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            streamed += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert (streamed, text) == (reasoning, content)
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == tokens
    plain = client.chat.completions.create(**ask, max_tokens=MAX_NEW)  # (the other tests: equal to transformers)
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
