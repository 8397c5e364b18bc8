from __future__ import annotations

from pathlib import Path

import torch

from ipc.messages import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampler import Sampler

CPU = torch.device("cpu")


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits()
    params = [SamplingParams(temperature=0.0)] * 4
    assert Sampler(CPU).sample(x, ["a", "b", "c", "d"], params) == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_reduce_to_argmax() -> None:
    x = logits()
    rids = ["a", "b", "c", "d"]
    s = Sampler(CPU)
    assert s.sample(x, rids, [SamplingParams(temperature=1.5, top_k=1)] * 4) == x.argmax(-1).tolist()
    assert s.sample(x, rids, [SamplingParams(temperature=1.5, top_p=1e-6)] * 4) == x.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best() -> None:
    x = logits(rows=1, vocab=50)
    best3 = set(torch.topk(x[0], 3).indices.tolist())
    s = Sampler(CPU, seed=1)
    draws = {s.sample(x, ["r"], [SamplingParams(temperature=5.0, top_k=3)])[0] for _ in range(200)}
    assert draws <= best3 and len(draws) > 1


def test_seed_reproduces_whatever_else_is_sampled() -> None:
    x = logits(rows=1)
    p = SamplingParams(temperature=4.0, seed=1234)
    first = Sampler(CPU, seed=7)
    first.add("r", p)
    a = [first.sample(x, ["r"], [p])[0] for _ in range(20)]
    second = Sampler(CPU, seed=99)  # different default generator, interleaved unseeded draws
    second.add("r", p)
    b = []
    for _ in range(20):
        second.sample(x, ["other"], [SamplingParams(temperature=1.0)])
        b.append(second.sample(x, ["r"], [p])[0])
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
