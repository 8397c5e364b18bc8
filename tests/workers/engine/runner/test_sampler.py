from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ipc.prompts import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine
from workers.engine.runner.sampler import Sampler

CPU = torch.device("cpu")


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert Sampler(CPU).sample(x, ["a", "b", "c", "d"], params).tokens == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_reduce_to_argmax() -> None:
    x = logits()
    rids = ["a", "b", "c", "d"]
    s = Sampler(CPU)
    assert s.sample(x, rids, [SamplingParams(temperature=1.5, top_k=1)] * 4).tokens == x.argmax(-1).tolist()
    assert s.sample(x, rids, [SamplingParams(temperature=1.5, top_p=1e-6)] * 4).tokens == x.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best() -> None:
    x = logits(rows=1, vocab=50)
    best3 = set(torch.topk(x[0], 3).indices.tolist())
    s = Sampler(CPU, seed=1)
    draws = {s.sample(x, ["r"], [SamplingParams(temperature=5.0, top_k=3)]).tokens[0] for _ in range(200)}
    assert draws <= best3 and len(draws) > 1


def test_seed_reproduces_whatever_else_is_sampled() -> None:
    x = logits(rows=1)
    p = SamplingParams(temperature=4.0, seed=1234)
    first = Sampler(CPU, seed=7)
    first.add("r", p)
    a = [first.sample(x, ["r"], [p]).tokens[0] for _ in range(20)]
    second = Sampler(CPU, seed=99)  # different default generator, interleaved unseeded draws
    second.add("r", p)
    b = []
    for _ in range(20):
        second.sample(x, ["other"], [SamplingParams(temperature=1.0)])
        b.append(second.sample(x, ["r"], [p]).tokens[0])
    assert a == b and len(set(a)) > 1


def test_stop_strings_and_stop_tokens_end_generation(demo_model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=128))
    messages = [{"role": "user", "content": "Tell me about the chart."}]
    [free] = engine.generate([messages], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    # Stop at the third generated token's id: generation ends right there, reason "stop".
    stop_id = free.token_ids[2]
    [by_token] = engine.generate(
        [messages], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    )
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    # A stop string cut out of the middle of the free-running text: the output ends before it.
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    [by_text] = engine.generate([messages], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))
    assert by_text.finish_reason == "stop"
    assert by_text.text == free.text[: free.text.index(stop)]


# ---- logit processing, batched, against a plain-Python reference -------------------------------------


def reference_processed(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """What the processed logits of one row must be: bias, then the penalties, written the slow way."""
    out = list(row)
    for token, bias in p.logit_bias:
        out[token] += bias
    seen = set(prompt) | set(output)
    for token in range(len(out)):
        count = output.count(token)
        if token in seen:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_batched_processing_equals_reference_per_row() -> None:
    vocab = 40
    x = logits(rows=4, vocab=vocab, seed=3)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7, logprobs=5),
        SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=-0.4, logprobs=0),
        SamplingParams(temperature=0, logit_bias=((3, 5.0), (7, -100.0)), logprobs=3),
        SamplingParams(temperature=0),  # no processing: its row must be left as it is
    ]
    prompts = [[1, 2, 3, 9], [4, 5], [6], [7]]
    outputs = [[2, 11, 11], [5, 5, 8, 12], [], [0]]
    rids = ["a", "b", "c", "d"]
    # Register prompt and output apart, as a worker does after a preemption (num_output).
    s = Sampler(CPU, vocab_size=vocab)
    for rid, p, prompt, out in zip(rids, params, prompts, outputs):
        s.add(rid, p, prompt, out)
    result = s.sample(x, rids, params)
    for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        ref = torch.tensor(reference_processed(x[i].tolist(), p, prompt, out))
        assert result.tokens[i] == int(ref.argmax())
        if p.logprobs is None:
            continue
        lp = torch.log_softmax(ref, dim=-1)
        [entry] = [e for e in result.logprobs if e.rid == rids[i]]
        assert abs(entry.logprob - float(lp[result.tokens[i]])) < 1e-5
        assert entry.top_ids == (lp.topk(p.logprobs).indices.tolist() if p.logprobs else [])
        assert entry.top_ids[:1] in ([result.tokens[i]], [])  # greedy: the sampled token is the top-1
    assert not any(e.rid == "d" for e in result.logprobs)


def test_penalties_count_each_sampled_token() -> None:
    vocab = 10
    row = torch.zeros(1, vocab)
    row[0, 4] = 1.0  # token 4 wins until its count outweighs its lead
    p = SamplingParams(temperature=0, frequency_penalty=0.4)
    s = Sampler(CPU, vocab_size=vocab)
    s.add("r", p, [], [])
    picks = [s.sample(row, ["r"], [p]).tokens[0] for _ in range(5)]
    # 1.0, 0.6, 0.2 stay ahead of 0; after three 4s its logit is -0.2 and token 0 (first of the ties) wins.
    assert picks[:3] == [4, 4, 4] and picks[3] == 0


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab = 10
    row = torch.zeros(1, vocab)
    row[0, 9] = 5.0  # the EOS id is by far the best
    row[0, 8] = 4.0  # then a stop id
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(8,))
    s = Sampler(CPU, vocab_size=vocab, eos_token_ids=(9,))
    s.add("r", p)
    assert [s.sample(row, ["r"], [p]).tokens[0] for _ in range(3)] == [0, 0, 9]


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    x = torch.tensor([[4.0, 3.9, 0.0, -1.0, 3.0]])
    p = SamplingParams(temperature=1.0, min_p=0.5)
    s = Sampler(CPU, seed=3)
    # p(4.0) / p(3.0) = e, so 3.0 is dropped at min_p 0.5; 3.9 stays (e^-0.1 > 0.5).
    assert {s.sample(x, ["r"], [p]).tokens[0] for _ in range(200)} == {0, 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_log_probabilities_do_not_make_the_host_wait_on_cuda() -> None:
    """Sampling with log probabilities queues their copies: no call in it synchronizes with the device (which would
    stop the worker from planning the next step while this one runs), and the entries read afterwards are the
    CPU's."""
    x = logits(rows=3)
    rids = ["a", "b", "c"]
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]  # fmt: skip
    gpu = Sampler(torch.device("cuda"))
    on_device = x.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        out = gpu.sample(on_device, rids, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = Sampler(CPU).sample(x, rids, params)
    assert out.tokens == want.tokens
    got, ref = out.logprobs, want.logprobs
    assert [(e.rid, e.top_ids) for e in got] == [(e.rid, e.top_ids) for e in ref] and len(got) == 2
    for a, b in zip(got, ref, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
