"""Prompt log probabilities on /v1/completions (``echo`` with ``logprobs``, ``max_tokens`` 0, vLLM's
``prompt_logprobs``, batches of prompts), through the real server and the official openai client, against
transformers' log-softmax of the same demo checkpoint: what lm-eval's loglikelihood tasks read.

The server prefills in 16-token chunks, so most prompts here span several chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.reference import HFReference
from tests.server.live import LiveServer, serving
from workers.scheduler.logprobs import LogprobRenderer

SHORT = "Read the invoice total."  # under one chunk
LONG = "The invoice lists seven rows of monthly numbers; add them up and read the total aloud. " * 3
CHUNK = 16


@pytest.fixture(scope="module")
def live(demo_model_dir: Path) -> Iterator[LiveServer]:
    yield from serving(demo_model_dir, "--chunk-size", str(CHUNK), "--lone-prefill-tokens", "0")


@pytest.fixture(scope="module")
def text_of(ref: HFReference) -> LogprobRenderer:
    """Token id -> the text the server's logprobs show for it."""
    return LogprobRenderer(ref.tokenizer)


def ids_of(ref: HFReference, text: str) -> list[int]:
    return [int(t) for t in ref.tokenizer(text)["input_ids"]]


@torch.inference_mode()
def log_softmax(ref: HFReference, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every position of ``ids``: row i scores the token after ids[i]."""
    return torch.log_softmax(ref.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def complete(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True, **fields}
    return server.client().completions.create(**args)


def check_choice(ref: HFReference, text_of: LogprobRenderer, ids: list[int], choice: Any, generated: int) -> None:
    """The choice echoes ``ids`` with transformers' numbers, then ``generated`` greedy tokens."""
    lp = log_softmax(ref, ids)
    out = choice.logprobs
    assert len(out.tokens) == len(out.token_logprobs) == len(out.top_logprobs) == len(ids) + generated
    assert out.tokens[: len(ids)] == [text_of.token(t)[0] for t in ids]
    assert out.token_logprobs[0] is None and out.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(out.token_logprobs[i] - float(lp[i - 1, ids[i]])) < 1e-4, i
        # The most likely token, and (OpenAI's rule) the prompt's own token when it is not that one.
        best = int(lp[i - 1].argmax())
        expected = {text_of.token(best)[0]: float(lp[i - 1, best])}
        expected.setdefault(text_of.token(ids[i])[0], float(lp[i - 1, ids[i]]))
        top = out.top_logprobs[i]
        assert top.keys() == expected.keys(), i
        assert all(abs(top[t] - expected[t]) < 1e-4 for t in top), i
    if generated:  # greedy: the generated token is transformers' argmax after the prompt
        best = int(lp[-1].argmax())
        assert out.tokens[len(ids)] == text_of.token(best)[0]
        assert abs(out.token_logprobs[len(ids)] - float(lp[-1, best])) < 1e-4
    assert out.text_offset[0] == 0 and out.text_offset == sorted(out.text_offset)


def test_echo_logprobs_equal_transformers_log_softmax(live: LiveServer, ref: HFReference, text_of: LogprobRenderer) -> None:
    ids = ids_of(ref, SHORT)
    resp = complete(live, prompt=ids)
    choice = resp.choices[0]
    check_choice(ref, text_of, ids, choice, 1)
    assert choice.text.startswith(ref.tokenizer.decode(ids)) and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 1
    two = complete(live, prompt=ids, n=2)  # forked choices share the prompt, and report it each
    for choice in two.choices:
        check_choice(ref, text_of, ids, choice, 1)


def test_a_prompt_over_several_chunks_twice_without_prefix_hits(
    live: LiveServer, ref: HFReference, text_of: LogprobRenderer
) -> None:
    ids = ids_of(ref, LONG)
    assert len(ids) > 3 * CHUNK
    first = complete(live, prompt=ids, logprobs=3)
    lp = log_softmax(ref, ids)
    check_choice(ref, text_of, ids, complete(live, prompt=ids).choices[0], 1)
    for i in range(1, len(ids)):  # the three best at every position, across chunk boundaries
        best = lp[i - 1].topk(3)
        expected = {text_of.token(int(t))[0]: float(v) for t, v in zip(best.indices, best.values, strict=True)}
        expected.setdefault(text_of.token(ids[i])[0], float(lp[i - 1, ids[i]]))  # the chosen token is always listed
        # Keyed by text: tokens of the same text (partial UTF-8 characters shown as U+FFFD) share an entry.
        top = first.choices[0].logprobs.top_logprobs[i]
        assert top.keys() == expected.keys()
        assert all(abs(top[t] - expected[t]) < 1e-4 or t == "\ufffd" for t in top)
    second = complete(live, prompt=ids, logprobs=3)
    assert second.usage.prompt_tokens_details.cached_tokens == 0  # every prompt position was computed
    assert second.choices[0].logprobs == first.choices[0].logprobs
    # The blocks were published all the same: a request without prompt logprobs reuses them.
    plain = live.client().completions.create(model="demo", prompt=ids, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16


def test_max_tokens_zero_echoes_the_prompt_alone(live: LiveServer, ref: HFReference, text_of: LogprobRenderer) -> None:
    ids = ids_of(ref, LONG)
    resp = complete(live, prompt=ids, max_tokens=0)
    choice = resp.choices[0]
    assert choice.text == ref.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    check_choice(ref, text_of, ids, choice, 0)
    plain = complete(live, prompt=SHORT, max_tokens=0, logprobs=None)
    assert plain.choices[0].text == SHORT and plain.choices[0].logprobs is None
    streamed = list(complete(live, prompt=SHORT, max_tokens=0, stream=True))
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == SHORT
    with pytest.raises(openai.BadRequestError) as info:
        complete(live, prompt=SHORT, max_tokens=0, echo=False)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_a_batch_of_token_id_prompts(live: LiveServer, ref: HFReference, text_of: LogprobRenderer) -> None:
    prompts = [ids_of(ref, LONG), ids_of(ref, SHORT)]
    resp = complete(live, prompt=prompts)
    assert [c.index for c in resp.choices] == [0, 1]
    for ids, choice in zip(prompts, resp.choices, strict=True):
        check_choice(ref, text_of, ids, choice, 1)
        assert choice.text.startswith(ref.tokenizer.decode(ids))
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts) and resp.usage.completion_tokens == 2
    texts = complete(live, prompt=[SHORT, "Total: "], logprobs=None, max_tokens=2)
    assert [c.text[: len(p)] for c, p in zip(texts.choices, [SHORT, "Total: "], strict=True)] == [SHORT, "Total: "]


def test_lm_eval_loglikelihood_equals_transformers(live: LiveServer, ref: HFReference) -> None:
    """What lm-eval's local-completions model sends for loglikelihood requests, and how it reads the answer."""
    pairs = [(SHORT, " It is 42 dollars."), (LONG, " Done.")]
    contexts = [ids_of(ref, c) for c, _ in pairs]
    conts = [ids_of(ref, c + k)[len(ctx) :] for (c, k), ctx in zip(pairs, contexts, strict=True)]
    payload = {
        "model": "demo", "prompt": [c + k for c, k in zip(contexts, conts, strict=True)], "temperature": 0,
        "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True,
    }
    out = httpx.post(live.base + "/v1/completions", json=payload, timeout=60).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, ctx, cont in zip(choices, contexts, conts, strict=True):
        ctxlen = len(ctx)
        got = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        greedy = True
        for tok, top in zip(choice["logprobs"]["tokens"][ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1], strict=True):
            greedy &= max(top.keys(), key=lambda t: top[t]) == tok
        lp = log_softmax(ref, ctx + cont)
        want = sum(float(lp[ctxlen + j - 1, t]) for j, t in enumerate(cont))
        assert abs(got - want) < 1e-3
        assert greedy == all(int(lp[ctxlen + j - 1].argmax()) == t for j, t in enumerate(cont))


def test_vllm_prompt_logprobs_shape(live: LiveServer, ref: HFReference, text_of: LogprobRenderer) -> None:
    ids = ids_of(ref, LONG)
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(live.base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["logprobs"] is None
    got = choice["prompt_logprobs"]
    lp = log_softmax(ref, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row, token = lp[i - 1], ids[i]
        entries = got[i]
        mine = entries[str(token)]
        assert abs(mine["logprob"] - float(row[token])) < 1e-4 and mine["decoded_token"] == text_of.token(token)[0]
        assert mine["rank"] == 1 + int((row > row[token]).sum())
        best = row.topk(2).indices.tolist()
        assert [entries[str(t)]["rank"] for t in best] == [1, 2] or token in best
        assert set(entries) == {str(t) for t in [token, *best]}
    with pytest.raises(openai.BadRequestError) as info:
        live.client().completions.create(
            model="demo", prompt=ids, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_streamed_echo_logprobs_equal_the_whole_answer(live: LiveServer, ref: HFReference) -> None:
    ids = ids_of(ref, LONG)
    whole = complete(live, prompt=ids, max_tokens=4).choices[0]
    chunks = list(complete(live, prompt=ids, max_tokens=4, stream=True))
    parts = [c for chunk in chunks for c in chunk.choices]
    assert "".join(c.text for c in parts) == whole.text
    assert parts[0].text.startswith(ref.tokenizer.decode(ids))  # the echo comes with the prompt's logprobs
    tokens = [t for c in parts if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in parts if c.logprobs for v in c.logprobs.token_logprobs]
    offsets = [v for c in parts if c.logprobs for v in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_sglang_generate_return_logprob_as_lm_eval_reads_it(live: LiveServer, ref: HFReference, text_of: LogprobRenderer) -> None:
    """lm-eval's ``sglang-generate`` loglikelihood: a batch of token ids, max_new_tokens 1, the prompt's logprobs from
    position 0 with the best alternative; it sums input_token_logprobs[ctxlen:] and compares each with the best."""
    ids = ids_of(ref, LONG)
    body = {"input_ids": [ids], "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "logprob_start_len": 0,
            "top_logprobs_num": 1, "return_logprob": True}  # fmt: skip
    resp = httpx.post(live.base + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    [out] = resp.json()  # a batch (of one): a list, as SGLang answers it
    meta, lp = out["meta_info"], log_softmax(ref, ids)
    inputs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [e[1] for e in inputs] == ids and inputs[0] == [None, ids[0], None] and tops[0] is None
    for i in range(1, len(ids)):
        assert abs(inputs[i][0] - float(lp[i - 1, ids[i]])) < 1e-4 and inputs[i][2] is None, i
        [[value, best, text]] = tops[i]
        assert best == int(lp[i - 1].argmax()) and abs(value - float(lp[i - 1, best])) < 1e-4 and text is None, i
    ctxlen = 7
    expected = float(sum(lp[i - 1, ids[i]] for i in range(ctxlen, len(ids))))
    assert abs(sum(e[0] for e in inputs[ctxlen:]) - expected) < 1e-3
    [[value, token, _]] = meta["output_token_logprobs"]
    assert token == out["output_ids"][0] == int(lp[-1].argmax()) and abs(value - float(lp[-1, token])) < 1e-4
    assert meta["output_top_logprobs"] == [[[value, token, None]]]

    # Streamed, from position 3, with texts: the prompt's entries in the first event, each token's in its own.
    body = {"text": SHORT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "logprob_start_len": 3, "return_logprob": True, "return_text_in_logprobs": True, "stream": True}
    with httpx.stream("POST", live.base + "/generate", json=body, timeout=60) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    short = ids_of(ref, SHORT)
    first = events[0]["meta_info"]["input_token_logprobs"]
    assert [(e[1], e[2]) for e in first] == [(t, text_of.token(t)[0]) for t in short[3:]]
    generated = [e for ev in events for e in ev["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in generated] == [i for ev in events for i in ev["output_ids"]] and len(generated) == 3
    assert all(e[2] == text_of.token(e[1])[0] for e in generated) and "output_top_logprobs" not in events[0]["meta_info"]
