"""Sampling parameters through the real server and the official openai client, against transformers on the
demo checkpoint: every penalty changes greedy output exactly as a reference implementation over
transformers' logits predicts, and logprobs are transformers' log-softmax of the same step (after the
penalties and masks), with the sampled token on top."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reference import HFReference, Process, penalize
from tests.server.live import LiveServer, data_url, image_message, png_bytes

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Describe the table of numbers in the invoice."}]
MAX = 16


def ask(server: LiveServer, **fields: Any) -> Any:
    args: dict[str, Any] = {"model": "demo", "messages": MESSAGES, "max_tokens": MAX, "temperature": 0, **fields}
    return server.client().chat.completions.create(**args)


def check_against(ref: HFReference, resp: Any, process: Process | None) -> list[int]:
    """The answer's text and every token's logprobs equal the reference greedy loop's."""
    prompt = ref.prompt_ids(MESSAGES)
    ids, steps = ref.greedy(prompt, MAX, process)
    choice = resp.choices[0]
    assert choice.message.content == ref.text(ids)
    assert resp.usage.completion_tokens == len(ids)
    content = choice.logprobs.content
    assert len(content) == len(ids)
    for token_id, entry, lp in zip(ids, content, steps, strict=True):
        assert abs(entry.logprob - float(lp[token_id])) < 1e-4
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        top = lp.topk(len(entry.top_logprobs))
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        # Greedy: the sampled token is the top-1.
        assert token_id == int(lp.argmax())
        if entry.top_logprobs:
            assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
    # A token's bytes may be part of a character; all of them together are the answer's bytes (a random
    # model may emit byte sequences that are not UTF-8: both sides then decode them to U+FFFD).
    whole = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert whole == ref.tokenizer.decode(ids, skip_special_tokens=False)
    return ids


def test_greedy_logprobs_equal_transformers_log_softmax(live: LiveServer, ref: HFReference) -> None:
    resp = ask(live, logprobs=True, top_logprobs=5)
    check_against(ref, resp, None)
    assert all(len(e.top_logprobs) == 5 for e in resp.choices[0].logprobs.content)


def test_logprobs_absent_unless_asked_and_streamed_per_chunk(live: LiveServer, ref: HFReference) -> None:
    assert ask(live).choices[0].logprobs is None
    chunks = list(ask(live, logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []]
    whole = ask(live, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole]


@pytest.mark.parametrize(
    ("fields", "process"),
    [
        ({"presence_penalty": 2.0}, penalize(presence=2.0)),
        ({"presence_penalty": -2.0}, penalize(presence=-2.0)),
        ({"frequency_penalty": 2.0}, penalize(frequency=2.0)),
        ({"frequency_penalty": -1.5}, penalize(frequency=-1.5)),
        ({"extra_body": {"repetition_penalty": 1.8}}, penalize(repetition=1.8)),
        (
            {"frequency_penalty": 0.5, "presence_penalty": 0.3, "extra_body": {"repetition_penalty": 1.3}},
            penalize(frequency=0.5, presence=0.3, repetition=1.3),
        ),
    ],
    ids=["presence", "presence-negative", "frequency", "frequency-negative", "repetition", "all-three"],
)
def test_penalties_change_greedy_output_as_the_reference_predicts(
    live: LiveServer, ref: HFReference, fields: dict[str, Any], process: Process
) -> None:
    ids = check_against(ref, ask(live, logprobs=True, top_logprobs=3, **fields), process)
    plain, _ = ref.greedy(ref.prompt_ids(MESSAGES), MAX)
    assert ids != plain  # the penalty really changed the answer


def test_logit_bias_and_min_tokens(live: LiveServer, ref: HFReference) -> None:
    plain, _ = ref.greedy(ref.prompt_ids(MESSAGES), MAX)
    bias = {plain[2]: -100.0, plain[5]: 3.0}
    ids = check_against(
        ref, ask(live, logprobs=True, logit_bias={str(k): v for k, v in bias.items()}), penalize(bias=bias)
    )
    assert ids != plain
    # The second greedy token as a stop token: min_tokens masks it (and EOS) for the first 5 tokens.
    stop = plain[1]
    resp = ask(live, logprobs=True, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    process = penalize(min_tokens=5, stop_ids=(stop, *ref.eos_ids))
    prompt = ref.prompt_ids(MESSAGES)
    ids, _ = ref.greedy(prompt, MAX, process)
    if stop in ids:
        ids = ids[: ids.index(stop) + 1]
    assert resp.choices[0].message.content == ref.text(ids)
    assert len(ids) > 2 and resp.usage.completion_tokens == len(ids)


def test_out_of_range_parameters_are_refused_naming_them(live: LiveServer) -> None:
    import openai

    for fields, param in [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"extra_body": {"top_k": 2**64}}, "top_k"),
        ({"extra_body": {"stop_token_ids": [-5]}}, "stop_token_ids"),
        ({"extra_body": {"stop_token_ids": [2**64 + 5]}}, "stop_token_ids"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"extra_body": {"thinking_token_budget": 64}}, "thinking_token_budget"),  # the demo runs no reasoning parser
        ({"extra_body": {"thinking_token_budget": -1}}, "thinking_token_budget"),
        ({"extra_body": {"documents": [{"title": "t", "text": "x"}]}}, "documents"),  # the demo's template has none
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            ask(live, **fields)
        assert info.value.body["param"] == param  # type: ignore[index]


def test_generation_config_defaults_apply_to_fields_left_out(demo_model_dir: Path, ref: HFReference, tmp_path: Path) -> None:
    model = tmp_path / "with-defaults"
    shutil.copytree(demo_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    # Near-greedy with a repetition penalty, the shape of Qwen's own generation_config.json.
    config.update(temperature=0.7, top_k=1, repetition_penalty=1.8)
    (model / "generation_config.json").write_text(json.dumps(config))
    server = LiveServer(model, "--tokenizer-workers", "1")
    try:
        prompt = ref.prompt_ids(MESSAGES)
        resp = server.client().chat.completions.create(model="demo", messages=MESSAGES, max_tokens=MAX)  # type: ignore[arg-type]
        ids, _ = ref.greedy(prompt, MAX, penalize(repetition=1.8))
        assert resp.choices[0].message.content == ref.text(ids)
        # A field the request sends wins over the checkpoint's default.
        resp = server.client().chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=MAX, extra_body={"repetition_penalty": 1.0}  # type: ignore[arg-type]
        )
        plain, _ = ref.greedy(prompt, MAX)
        assert resp.choices[0].message.content == ref.text(plain)
    finally:
        assert server.stop() == 0, server.output()


def test_generation_config_flag_none_turns_defaults_off(demo_model_dir: Path, tmp_path: Path) -> None:
    import argparse

    from server.serve_cli import add_serve
    from server.serve_config import build_config

    model = tmp_path / "m"
    shutil.copytree(demo_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.5, "do_sample": True}))
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    auto = build_config(parser.parse_args(["serve", "--model", str(model), "--device", "cpu"]))
    assert auto.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}
    off = build_config(parser.parse_args(["serve", "--model", str(model), "--device", "cpu", "--generation-config", "none"]))
    assert off.sampling_defaults == {}


# ---- n > 1 ------------------------------------------------------------------------------------------


def test_n_choices_share_one_prefill_and_one_image_encode(live: LiveServer) -> None:
    messages = image_message("What is on this page?", [data_url(png_bytes(150, 100, seed=77))])
    before = live.settled_stats()
    resp = live.client().chat.completions.create(
        model="demo", messages=messages, max_tokens=8, temperature=0, n=3, extra_body={"ignore_eos": True}  # type: ignore[arg-type]
    )
    after = live.settled_stats()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 1  # greedy: three identical choices
    assert resp.usage.completion_tokens == 3 * 8
    # One prefill: every prompt token not found in the prefix cache is computed once, not three times.
    computed = resp.usage.prompt_tokens - resp.usage.prompt_tokens_details.cached_tokens
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == computed
    assert after["images_encoded"] - before["images_encoded"] == 1
    alone = live.client().chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert alone.choices[0].message.content == resp.choices[0].message.content


def test_n_choices_stream_by_index_as_they_answer_whole(live: LiveServer) -> None:
    fields: dict[str, Any] = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10, "logprobs": True}
    whole = ask(live, **fields)
    texts = {i: "" for i in range(3)}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in ask(live, stream=True, stream_options={"include_usage": True}, **fields):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len(set(texts.values())) == 3  # each choice drew its own tokens
    assert set(finishes) == {0, 1, 2} and usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_at_the_top_of_the_seed_range(live: LiveServer) -> None:
    """Choice i samples with seed + i: at seed 2**64 - 1 that wraps around instead of overflowing the messages to the
    model worker (it used to end the scheduler process, and with it the server)."""
    for seed in (2**64 - 1, -(2**63)):
        resp = live.client().chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, temperature=1.0,
            n=3, seed=seed, extra_body={"ignore_eos": True},
        )
        assert [len(c.message.content or "") > 0 for c in resp.choices] == [True] * 3
        again = live.client().chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, temperature=1.0,
            n=3, seed=seed, extra_body={"ignore_eos": True},
        )
        assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
    assert httpx.get(f"{live.base}/health", timeout=10).status_code == 200


def test_stop_reason_names_the_stop_that_matched(live: LiveServer, ref: HFReference) -> None:
    """vLLM's ``stop_reason`` (the stop string, or the stop_token_ids entry sampled; null for length and end tokens),
    Anthropic's ``stop_sequence`` and SGLang's ``finish_reason.matched`` name what ended the answer."""
    plain, _ = ref.greedy(ref.prompt_ids(MESSAGES), MAX)
    text = ref.text(plain)
    assert len(plain) == MAX and len(text) > 8  # the random demo runs to max_tokens
    cut = next(i for i in range(len(text) // 2, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[cut:cut + 3]  # a 3-character stop string whose first occurrence is mid-answer

    whole = ask(live, stop=[stop, "never in it"])
    choice = whole.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", text[:cut])
    assert choice.model_extra["stop_reason"] == stop
    assert ask(live).choices[0].model_extra["stop_reason"] is None  # ended by length
    chunks = list(ask(live, stop=[stop], stream=True))
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices] == [None] * (len(chunks) - 1) + [stop]
    # A stop token id: the id itself.
    token = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
    by_id = ask(live, extra_body={"stop_token_ids": [token]}).choices[0]
    assert (by_id.finish_reason, by_id.model_extra["stop_reason"]) == ("stop", token)

    done = live.client().completions.create(model="demo", prompt="Invoice total", max_tokens=MAX, temperature=0)
    ctext = done.choices[0].text
    ccut = next(i for i in range(len(ctext) // 2, len(ctext) - 3) if ctext.find(ctext[i:i + 3]) == i)
    cstop = ctext[ccut:ccut + 3]
    stopped = live.client().completions.create(model="demo", prompt="Invoice total", max_tokens=MAX, temperature=0,
                                               stop=cstop).choices[0]  # fmt: skip
    assert (stopped.text, stopped.finish_reason, stopped.model_extra["stop_reason"]) == (ctext[:ccut], "stop", cstop)

    message = httpx.post(live.base + "/v1/messages", timeout=60, json={
        "model": "demo", "max_tokens": MAX, "temperature": 0, "messages": MESSAGES, "stop_sequences": [stop]}).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", stop)
    assert message["content"] == [{"type": "text", "text": text[:cut]}]

    sglang = httpx.post(live.base + "/generate", timeout=60, json={
        "text": "Invoice total", "sampling_params": {"max_new_tokens": MAX, "temperature": 0, "stop": [cstop]}}).json()
    assert sglang["text"] == ctext[:ccut] and sglang["meta_info"]["finish_reason"] == {"type": "stop", "matched": cstop}
