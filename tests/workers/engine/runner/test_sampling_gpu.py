"""CUDA: the batched sampler (penalties, biases, logprobs, seeded draws), n > 1 forks with their KV block
copies and CUDA-graph decodes, and grammar masks give what the CPU gives (float32 on both)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ipc.prompts import SamplingParams, StructuredSpec
from workers.engine.config import EngineConfig
from workers.engine.offline import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Describe the table of numbers in the invoice."}]


def engine(model_dir: Path, device: str) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device=device, dtype="float32", num_kv_blocks=256))


def test_processed_greedy_and_forks_match_the_cpu(demo_model_dir: Path) -> None:
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3, presence_penalty=1.5),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.7, logit_bias=((7, 4.0),)),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=1.0, n=3),
    ]
    outs = {d: engine(demo_model_dir, d).generate([MESSAGES] * 3, params) for d in ("cpu", "cuda")}
    assert [o.token_ids for o in outs["cuda"]] == [o.token_ids for o in outs["cpu"]]
    assert len(outs["cuda"]) == 5 and outs["cuda"][2].token_ids == outs["cuda"][4].token_ids


def test_seeded_choices_on_cuda(demo_model_dir: Path) -> None:
    gpu = engine(demo_model_dir, "cuda")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=5, ignore_eos=True, n=3)
    first = [o.token_ids for o in gpu.generate([MESSAGES], params)]
    again = [o.token_ids for o in engine(demo_model_dir, "cuda").generate([MESSAGES], params)]
    assert first == again and len({tuple(t) for t in first}) == 3
    one = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=6, ignore_eos=True)
    [alone] = engine(demo_model_dir, "cuda").generate([MESSAGES], one)
    assert alone.token_ids == first[1]


def test_json_schema_on_cuda(demo_model_dir: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    spec = StructuredSpec("json_schema", json.dumps(schema))
    gpu = engine(demo_model_dir, "cuda")
    outs = gpu.generate([MESSAGES] * 4, [SamplingParams(max_tokens=64, temperature=1.0, seed=s, structured=spec) for s in range(4)])
    for out in outs:
        value = json.loads(out.text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
