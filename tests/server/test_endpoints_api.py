"""/v1/completions, SGLang's /generate, /v1/models/{id}, cached_tokens and CORS through the real server and the
official openai client (/generate: read as sglang.bench_serving reads it), on the demo checkpoint (greedy completions
equal transformers')."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.reference import HFReference, greedy_text
from tests.server.conftest import ORIGIN
from tests.server.live import LiveServer, data_url, png_bytes
from workers.tokenizer.requests.chat import parse_request

PROMPT = "<|im_start|>user\nRead the invoice total.<|im_end|>\n<|im_start|>assistant\n"


def complete(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    return server.client().completions.create(**args)


def test_completion_of_a_string_equals_transformers_greedy(live: LiveServer, ref: HFReference) -> None:
    ids = ref.tokenizer(PROMPT)["input_ids"]
    assert ref.tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # a raw prompt's control tokens stay control tokens
    expected, _ = ref.greedy(ids, 12)
    resp = complete(live)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == ref.text(expected)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(expected)
    # The same prompt as token ids gives the same answer.
    assert complete(live, prompt=ids).choices[0].text == resp.choices[0].text
    assert complete(live, prompt=[ids]).choices[0].text == resp.choices[0].text


def test_completion_stream_echo_logprobs_and_n(live: LiveServer, ref: HFReference) -> None:
    whole = complete(live, logprobs=3)
    pieces = []
    usage = None
    for chunk in complete(live, logprobs=3, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        pieces.extend(chunk.choices)
    assert "".join(c.text for c in pieces) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    assert "".join(lp.tokens).startswith(whole.choices[0].text[:4])
    assert lp.text_offset[0] == 0 and all(len(top) == 3 for top in lp.top_logprobs)
    streamed_tokens = [t for c in pieces if c.logprobs for t in c.logprobs.tokens]
    assert streamed_tokens == lp.tokens
    echoed = complete(live, echo=True)
    assert echoed.choices[0].text == PROMPT + whole.choices[0].text
    three = complete(live, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2] and {c.text for c in three.choices} == {whole.choices[0].text}


def test_completion_refusals_name_the_parameter(live: LiveServer, demo_model_dir: Path) -> None:
    for fields, param in [
        ({"suffix": "end"}, "suffix"),
        ({"prompt": ["one", 2]}, "prompt"),
        ({"prompt": ["one", "two"], "n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"prompt": [1 << 30]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"extra_body": {"prompt_embeds": "AAAA"}}, "prompt_embeds"),
        ({"extra_body": {"priority": 2}}, "priority"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            complete(live, **fields)
        assert info.value.body["param"] == param  # type: ignore[index]
    # The image token is in the vocabulary's range: the refusal says it is the image token, not just the range.
    image_token = json.loads((demo_model_dir / "config.json").read_text())["image_token_id"]
    with pytest.raises(openai.BadRequestError) as info:
        complete(live, prompt=[image_token])
    assert f"not the image token {image_token}" in info.value.body["message"]  # type: ignore[index]


def test_models_retrieve(live: LiveServer, demo_model_dir: Path) -> None:
    card = live.client().models.retrieve("demo")
    assert card.id == "demo" and card.object == "model"
    # vLLM's `root`: `vllm bench serve` without --model takes the tokenizer path from the first listed model.
    listed = live.client().models.list().data[0]
    assert (card.root, listed.root) == (str(demo_model_dir), str(demo_model_dir))  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("gpt-9")


def test_cached_tokens_on_a_repeated_prompt(live: LiveServer) -> None:
    messages = [{"role": "user", "content": "Summarise the table of monthly numbers, row by row. " * 6}]
    first = live.client().chat.completions.create(model="demo", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    second = live.client().chat.completions.create(model="demo", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token blocks, all but the block holding the last prompt token (its logits are needed). The first time,
    # at most the chat template's opening blocks that other chats on this shared server began with.
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 and cached > 0
    assert first.usage.prompt_tokens_details.cached_tokens <= 16 < cached
    streamed = list(
        live.client().chat.completions.create(
            model="demo", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}  # type: ignore[arg-type]
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_cors_only_for_allowed_origins(live: LiveServer) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    pre = httpx.options(live.base + "/v1/chat/completions", headers=headers)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    got = httpx.get(live.base + "/v1/models", headers={"Origin": ORIGIN})
    assert got.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(live.base + "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    # A refused preflight is a 400 in OpenAI's error shape too (Starlette answers it in plain text).
    refused = httpx.options(live.base + "/v1/chat/completions", headers={**headers, "Origin": "https://evil.example"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "cors_preflight_refused", refused.text
    assert "access-control-allow-origin" not in refused.headers


def test_cors_is_off_by_default(demo_model_dir: Path) -> None:
    import argparse

    from server.serve_cli import add_serve

    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    assert parser.parse_args(["serve"]).allowed_origins == ""


def test_unknown_fields_are_ignored_with_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1, "zz_extra": {"a": 2}}'
    with caplog.at_level(logging.DEBUG, logger="glimpse.request"):
        req = parse_request(body)
    assert req.model == "m"
    lines = [r.getMessage() for r in caplog.records if r.name == "glimpse.request"]
    assert lines == ["ignoring unknown request fields: frobnicate, zz_extra"]


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(live: LiveServer) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    whole = complete(live)
    chunks: list[Any] = list(complete(live, stream=True, stream_options=options))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens and counts[0] < counts[-1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    request: dict[str, Any] = {"messages": [{"role": "user", "content": "Read the total."}], "stream_options": options}
    chat: Any = live.client().chat.completions.create(model="demo", max_tokens=6, temperature=0, stream=True, **request)
    chat_chunks = list(chat)
    usages = [c.usage for c in chat_chunks if c.choices and (c.choices[0].delta.content or c.choices[0].finish_reason)]
    assert usages and all(u is not None and u.completion_tokens >= 1 for u in usages)
    # The cached count is the scheduler's: the role chunk, sent before any output, does not say it (rather than 0),
    # and every later chunk says the same count as the last.
    assert chat_chunks[0].usage is not None and chat_chunks[0].usage.prompt_tokens_details is None
    cached = {c.usage.prompt_tokens_details.cached_tokens for c in chat_chunks[1:] if c.usage is not None}
    assert len(cached) == 1, cached
    plain = list(complete(live, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)  # only when asked for


def vllm_bench_read(server: LiveServer, body: dict[str, Any]) -> tuple[list[str], int | None]:
    """What `vllm bench serve`'s completions backend keeps of a stream: the text of every event with choices (it
    times each one: the first is the first token, every later one an inter-token gap) and the usage chunk's
    completion_tokens."""
    texts: list[str] = []
    tokens: int | None = None
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = "".join(resp.iter_text()).split("\n\n")
    for event in (e.strip() for e in events):
        if not event or event.startswith(":") or event == "data: [DONE]":
            continue
        data = json.loads(event.removeprefix("data: "))
        if choices := data.get("choices"):
            texts.append(choices[0].get("text") or "")
        elif usage := data.get("usage"):
            tokens = usage.get("completion_tokens")
    return texts, tokens


def test_a_token_that_adds_no_text_yet_still_gets_its_chunk(live: LiveServer) -> None:
    """A byte token that ends inside a UTF-8 character adds no text until the next token; vLLM still streams its
    chunk (text ""), and vllm bench serve times the first token by the first chunk: without one, a held first
    token's step read as prefill."""
    held = None
    for i in range(64):  # a prompt whose greedy answer opens with such a byte token (its logprobs token is U+FFFD)
        probe = complete(live, prompt=f"Invoice line {i}:", max_tokens=2, logprobs=0)
        if probe.choices[0].logprobs.tokens[0] == "\ufffd":
            held = f"Invoice line {i}:"
            break
    assert held is not None, "no demo prompt opens with a byte token"
    whole = complete(live, prompt=held, max_tokens=8)
    # The body `vllm bench serve --backend openai` sends (with --temperature 0 in its extra body).
    body = {"model": "demo", "prompt": held, "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    firsts = []
    for _ in range(12):  # a loop that fell behind joins steps into one chunk (vLLM's does too): one clean run will do
        texts, tokens = vllm_bench_read(live, body)
        assert tokens == whole.usage.completion_tokens == 8
        assert "".join(texts) == whole.choices[0].text and len(texts) <= tokens
        firsts.append(texts[0])
        if texts[0] == "":
            break
    assert firsts[-1] == "", firsts  # the held first token's own chunk, before the token that completes its text


def test_a_chat_token_that_adds_no_text_yet_still_gets_its_chunk(live: LiveServer) -> None:
    """The same on /v1/chat/completions, read as `vllm bench serve --backend openai-chat` reads it: every chunk
    with choices is timed, its text ``choices[0]["delta"].get("content")``."""
    messages = None
    for i in range(64):  # a question whose greedy answer has a byte token (U+FFFD in its logprobs) before its end
        probe = live.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": f"Invoice line {i}:"}],
                                                      max_tokens=8, temperature=0, logprobs=True)
        if "\ufffd" in [t.token for t in probe.choices[0].logprobs.content[:7]]:  # type: ignore[union-attr]
            messages = [{"role": "user", "content": [{"type": "text", "text": f"Invoice line {i}:"}]}]
            break
    assert messages is not None, "no demo question's answer holds a byte token"
    body = {"model": "demo", "messages": messages, "max_completion_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    empties = []
    for _ in range(12):  # a loop that fell behind joins steps into one chunk: one clean run will do
        with httpx.stream("POST", live.base + "/v1/chat/completions", json=body, timeout=60) as resp:
            events = [e.removeprefix("data: ") for e in "".join(resp.iter_text()).split("\n\n") if e.strip()]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert "".join(t or "" for t in contents) == probe.choices[0].message.content
        empties.append(contents[1:].count(""))  # contents[0]: the role chunk's ""
        if empties[-1]:
            break
    assert empties[-1] >= 1, empties  # the held token's own chunk


def generate(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base + "/generate", json=body, timeout=60)


def bench_serving_read(server: LiveServer, body: dict[str, Any]) -> tuple[str, int, list[int], list[int]]:
    """What sglang.bench_serving's ``sglang`` backend keeps of a streamed /generate: the last event's text and
    completion_tokens (each event holds everything so far), and each event's count of new tokens; and what AIPerf's
    SGLang endpoint keeps: every event's output_ids, joined up."""
    text, count, steps, ids = "", 0, [], []
    with httpx.stream("POST", server.base + "/generate", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    for n, line in enumerate(lines[:-1]):
        data = json.loads(line.removeprefix("data: "))
        assert data["text"].startswith(text)  # cumulative
        assert (data["meta_info"]["finish_reason"] is not None) == (n == len(lines) - 2)
        steps.append(data["meta_info"]["completion_tokens"] - count)
        assert len(data["output_ids"]) == steps[-1]  # the ids new since the previous event
        ids += data["output_ids"]
        text, count = data["text"], data["meta_info"]["completion_tokens"]
    return text, count, steps, ids


def test_sglang_generate_equals_transformers_greedy(live: LiveServer, ref: HFReference) -> None:
    ids = ref.tokenizer(PROMPT)["input_ids"]
    expected, _ = ref.greedy(ids, 12)
    # The body sglang.bench_serving sends with its default backend.
    body = {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": False},
            "stream": False, "lora_path": None, "return_logprob": False, "logprob_start_len": -1}
    resp = generate(live, body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["text"] == ref.text(expected) and out["output_ids"] == expected
    meta = out["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), len(expected))
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["id"].startswith("cmpl-")
    # Token ids give the same answer; streamed, the last event holds all of it.
    assert generate(live, {**body, "input_ids": ids}).json()["error"]["param"] == "text"  # exactly one of the two
    del body["text"]
    assert generate(live, {**body, "input_ids": ids}).json()["text"] == out["text"]
    text, count, steps, ids = bench_serving_read(live, {"text": PROMPT, "stream": True, "sampling_params":
                                                        {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    assert text.startswith(out["text"]) and count == 12 and sum(steps) == 12 and all(s >= 1 for s in steps)
    assert ids[: len(expected)] == expected and len(ids) == 12
    # AIPerf's SGLang endpoint: token ids in, a request id and priority 0 beside them, streamed.
    aiperf = {"rid": "x-1", "input_ids": ids, "sampling_params": {"ignore_eos": True, "max_new_tokens": 3},
              "stream": True, "priority": 0}
    assert len(bench_serving_read(live, aiperf)[3]) == 3


def test_sglang_generate_batches_and_refusals(live: LiveServer) -> None:
    params = {"temperature": 0, "max_new_tokens": 4}
    batch = generate(live, {"text": [PROMPT, PROMPT + "The"], "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 2
    alone = generate(live, {"text": PROMPT + "The", "sampling_params": params}).json()
    assert batch[1]["text"] == alone["text"] and batch[1]["meta_info"]["prompt_tokens"] > batch[0]["meta_info"]["prompt_tokens"]
    assert len(generate(live, {"text": PROMPT, "sampling_params": {**params, "n": 2}}).json()) == 2
    # Unset max_new_tokens: SGLang's default of 128.
    assert generate(live, {"text": PROMPT, "sampling_params": {"ignore_eos": True}}).json()["meta_info"][
        "completion_tokens"] == 128
    png = data_url(png_bytes(32, 32, seed=1))
    for body, param in [
        ({"text": PROMPT, "image_data": png}, "image_data"),  # the text has no image placeholder
        ({"text": PROMPT, "image_data": [png, 5]}, "image_data"),
        ({"text": PROMPT, "image_data": "data:image/png;base64,iVBORw0KGgo="}, "image_data[0]"),  # not an image
        ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        ({"text": PROMPT, "lora_path": "adapter"}, "lora_path"),
        ({"text": PROMPT, "priority": 5}, "priority"),
        ({"text": PROMPT, "frobnicate": 1}, "frobnicate"),
        ({"text": PROMPT, "sampling_params": {"ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": [PROMPT, PROMPT], "sampling_params": [{"top_k": 1}, {"top_k": 2}]}, "sampling_params"),
        ({"input_ids": [1 << 30]}, "input_ids"),
        ({"text": ""}, "text"),
    ]:
        resp = generate(live, body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, resp.json()


def test_sglang_generate_with_images_equals_transformers(live: LiveServer, ref: HFReference, demo_model_dir: Path) -> None:
    """bench_serving's image datasets: the processor's chat template applied client-side (one placeholder per image)
    and the images as data URLs in image_data."""
    question = "What is on the page?"
    raw = png_bytes(96, 64, seed=5)
    text = ref.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}], tokenize=False,
        add_generation_prompt=True,
    )
    resp = generate(live, {"text": text, "image_data": [data_url(raw)], "sampling_params": {"temperature": 0,
                                                                                           "max_new_tokens": 8}})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["text"] == greedy_text(demo_model_dir, [raw], question, 8)
    chat = live.client().chat.completions.create(
        model="demo", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw)}},
                                               {"type": "text", "text": question}]}],
    )  # fmt: skip
    assert out["meta_info"]["prompt_tokens"] == chat.usage.prompt_tokens and chat.choices[0].message.content == out["text"]
    streamed, count, _, ids = bench_serving_read(live, {"text": text, "image_data": data_url(raw), "stream": True,
                                                        "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert streamed == out["text"] and count == out["meta_info"]["completion_tokens"] and ids == out["output_ids"]
    refused = generate(live, {"text": text, "image_data": [data_url(raw), data_url(raw)]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "image_data"


def test_vllm_tokens_generate_serves_what_the_render_routes_answer(live: LiveServer, ref: HFReference) -> None:
    """llm-d's loop: render in one place, generate from the token ids in another (and AIPerf's vllm_generate body)."""
    ids = ref.tokenizer(PROMPT)["input_ids"]
    expected, _ = ref.greedy(ids, 12)
    [rendered] = httpx.post(live.base + "/v1/completions/render", timeout=60, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    resp = httpx.post(live.base + "/inference/v1/generate", json=rendered, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert set(out) == {"request_id", "choices", "prompt_logprobs", "kv_transfer_params"}
    [choice] = out["choices"]
    assert choice["token_ids"] == expected and choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    chat = {"model": "demo", "messages": [{"role": "user", "content": "Read the total."}], "max_tokens": 6,
            "temperature": 0, "logit_bias": {"5": 0.0}}
    rendered = httpx.post(live.base + "/v1/chat/completions/render", json=chat, timeout=60).json()
    tokens = httpx.post(live.base + "/inference/v1/generate", json=rendered, timeout=60).json()["choices"][0]
    assert tokens["token_ids"] == ref.greedy(rendered["token_ids"], 6)[0]
    aiperf = {"model": "demo", "token_ids": ids, "sampling_params": {"max_tokens": 5, "ignore_eos": True},
              "stream": False, "request_id": "r-1"}
    assert len(httpx.post(live.base + "/inference/v1/generate", json=aiperf).json()["choices"][0]["token_ids"]) == 5
    for body, param in [
        ({**aiperf, "stream": True}, "stream"),
        ({**aiperf, "features": {"mm_hashes": {"image": ["a"]}}}, "features"),
        ({**aiperf, "sampling_params": {"logprobs": 1}}, "sampling_params.logprobs"),
        ({**aiperf, "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
        ({**aiperf, "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ({**aiperf, "sampling_params": {"top_p": 5}}, "sampling_params.top_p"),
        ({**aiperf, "token_ids": []}, "token_ids"),
        ({**aiperf, "token_ids": [1 << 30]}, "token_ids"),
        ({**aiperf, "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ({**aiperf, "frobnicate": 1}, "frobnicate"),
        ({**aiperf, "max_tokens": 5}, "max_tokens"),  # misplaced: named as sent, not as sampling_params.max_tokens
    ]:
        refused = httpx.post(live.base + "/inference/v1/generate", json=body, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (param, refused.text)
