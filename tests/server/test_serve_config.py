"""`glimpse serve`'s flags as they become the frozen config: defaults that depend on the device."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from server.encoder_flags import SPLIT_LANDING_MB, landing_mb
from server.serve_cli import add_serve
from server.serve_config import build_config
from workers.engine.config import (
    FA3_KEY_TILE,
    HOST_CACHE_CAP_MB,
    HOST_CACHE_RAM_SHARE,
    EngineConfig,
    default_host_cache_mb,
    serving_kv_blocks,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("device", "backend", "given", "expected"),
    [
        ("cuda", "auto", (None, None), (FA3_KEY_TILE, None)),  # FA3 loads whole key tiles of a block with TMA
        ("cuda:1", "fa3", (None, None), (FA3_KEY_TILE, None)),
        ("cuda", "flash", (None, None), (16, None)),  # a backend that gathers the blocks gains nothing from larger ones
        ("cuda", "sdpa", (None, 12288), (16, 12288)),
        ("cpu", "auto", (None, 512), (16, 512)),
        # a count without a block size is in blocks of 16 tokens: the same 196,608 tokens in blocks of 128
        ("cuda", "auto", (None, 12288), (FA3_KEY_TILE, 1536)),
        ("cuda", "fa3", (None, 100), (FA3_KEY_TILE, 13)),  # 1,600 tokens: rounded up to whole blocks
        ("cuda", "auto", (64, 12288), (64, 12288)),  # an explicit block size keeps the count as given
        ("cuda", "auto", (16, None), (16, None)),
    ],
)
def test_serving_kv_blocks_follow_device_backend_and_the_flags(
    device: str, backend: str, given: tuple[int | None, int | None], expected: tuple[int, int | None]
) -> None:
    assert FA3_KEY_TILE == 128 and EngineConfig.block_size == 16
    assert serving_kv_blocks(device, backend, *given) == expected


def test_serve_takes_the_default_block_size_or_the_one_given(demo_model_dir: Path) -> None:
    assert build_config(parse("--model", str(demo_model_dir), "--device", "cpu")).engine.block_size == 16
    given = build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--block-size", "128"))
    assert given.engine.block_size == 128
    counted = build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--num-kv-blocks", "300"))
    assert (counted.engine.block_size, counted.engine.num_kv_blocks) == (16, 300)


def test_serve_refuses_a_block_size_below_one(demo_model_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--block-size"):
        build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--block-size", "0"))


def test_kv_event_flags_default_to_llm_ds_topic_and_need_an_endpoint(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu", "--served-model-name", "qwen", "--port", "8123")
    config = build_config(parse(*base, "--host", "10.1.2.3", "--kv-events-endpoint", "tcp://*:5557",
                                "--kv-events-replay-endpoint", "tcp://*:5558", "--kv-events-layout", "array"))
    assert config.kv_events_topic == "kv@10.1.2.3:8123@qwen"  # what llm-d's indexer splits into pod and model
    assert (config.kv_events_replay_endpoint, config.kv_events_buffer_steps, config.kv_events_layout) == (
        "tcp://*:5558", 10_000, "array")
    given = build_config(parse(*base, "--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv@p@m"))
    assert (given.kv_events_topic, given.kv_events_layout) == ("kv@p@m", "map")
    with pytest.raises(SystemExit, match="--kv-events-replay-endpoint"):
        build_config(parse(*base, "--kv-events-replay-endpoint", "tcp://*:5558"))


def test_host_cache_defaults_off_on_the_cpu_and_to_a_share_of_ram_on_cuda(demo_model_dir: Path) -> None:
    assert default_host_cache_mb("cpu", 1) == 0.0
    with open("/proc/meminfo") as f:
        total_mb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) / 1024
    for ranks in (1, 8):  # every rank pins its own copy: together at most the share of RAM
        assert default_host_cache_mb("cuda", ranks) == min(HOST_CACHE_CAP_MB, HOST_CACHE_RAM_SHARE * total_mb / ranks)
    assert build_config(parse("--model", str(demo_model_dir), "--device", "cpu")).engine.host_cache_bytes() == 0
    given = build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--mm-host-cache-mb", "2.5"))
    assert given.engine.mm_host_cache_mb == 2.5 and given.engine.host_cache_bytes() == int(2.5 * 2**20)


def test_kv_host_cache_is_off_by_default_and_refused_where_it_cannot_be_right(
    demo_model_dir: Path, qwen3_5_model_dir: Path, gemma4_model_dir: Path
) -> None:
    cpu = ("--device", "cpu")
    assert build_config(parse("--model", str(demo_model_dir), *cpu)).engine.kv_host_cache_mb == 0
    assert build_config(parse("--model", str(demo_model_dir), *cpu, "--kv-host-cache-mb", "64")).engine.kv_host_cache_mb == 64
    refused = [
        (qwen3_5_model_dir, (), "linear-attention"),  # a prefix hit there resumes from a state snapshot
        (gemma4_model_dir, (), "sliding-window"),  # its sliding layers' blocks live in a pool of their own
        (demo_model_dir, ("--no-prefix-caching",), "prefix caching"),
        (demo_model_dir, ("--kv-host-cache-mb", "-1"), "0 .off. or more"),
    ]
    for model, extra, why in refused:
        args = ("--model", str(model), *cpu, "--kv-host-cache-mb", "64", *extra)
        with pytest.raises(SystemExit, match=f"^glimpse serve: --kv-host-cache-mb .*{why}"):
            build_config(parse(*args))
    # Gemma 4 with every layer in the one pool takes it.
    args = ("--model", str(gemma4_model_dir), *cpu, "--kv-host-cache-mb", "64", "--num-window-blocks", "0")
    assert build_config(parse(*args)).engine.kv_host_cache_mb == 64


def test_encoder_worker_flags_become_the_config_and_their_devices(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu")
    config = build_config(parse(*base))
    assert (config.encoder_workers, config.encoder_devices) == (0, ())  # off by default: today's path
    split = build_config(parse(*base, "--encoder-workers", "2"))
    assert split.encoder_workers == 2 and split.encoder_device(1) == "cpu"
    for bad, why in [(("--encoder-workers", "-1"), "--encoder-workers"),
                     (("--encoder-workers", "1", "--mm-cache-mode", "request"), "--mm-cache-mode image"),
                     (("--encoder-devices", "0"), "--encoder-devices")]:  # GPU indices: CUDA and encoders only
        with pytest.raises(SystemExit, match=why):
            build_config(parse(*base, *bad))
    # On CUDA: the LM's GPUs of the encoder's replica by default (colocated), else the given ones in turn.
    cuda = replace(split, engine=replace(split.engine, device="cuda", tp_size=2), dp_size=2)
    assert [cuda.encoder_device(i) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    chosen = replace(cuda, encoder_devices=(5, 6, 7))
    assert [chosen.encoder_device(i) for i in range(4)] == ["cuda:5", "cuda:6", "cuda:7", "cuda:5"]


def test_shared_encoders_need_encoders_and_replicas_to_share_them(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu")
    assert build_config(parse(*base, "--dp", "2", "--encoder-workers", "1")).shared_encoders is False  # off by default
    shared = build_config(parse(*base, "--dp", "2", "--encoder-workers", "1", "--shared-encoders"))
    assert shared.shared_encoders and shared.encoder_count == 1
    for bad, why in [(("--shared-encoders", "--dp", "2"), "--encoder-workers 1 or more"),
                     (("--shared-encoders", "--encoder-workers", "1"), "--dp 2 or more"),
                     (("--shared-encoders",), "--encoder-workers 1 or more")]:
        with pytest.raises(SystemExit, match=f"^glimpse serve: --shared-encoders needs {why}"):
            build_config(parse(*base, *bad))


def test_encoders_on_gpus_of_their_own_get_a_landing_pool_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        def __init__(self, gib: int) -> None:
            self.total_memory = gib << 30

    sizes = {2: 141, 3: 24}
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: Props(sizes[i]))
    # model ranks on GPUs 0 .. lm_gpus - 1; encoders on others get a pool, capped by a quarter of the smallest card
    assert landing_mb(None, (2,), 2) == SPLIT_LANDING_MB
    assert landing_mb(None, (2, 3), 2) == 24 * 1024 // 4
    # an encoder sharing a model rank's GPU: shared memory (the KV budget does not count a pool), as without devices
    assert landing_mb(None, (1, 2), 2) == 0 and landing_mb(None, (), 1) == 0
    assert landing_mb(0, (2,), 2) == 0 and landing_mb(4096, (), 1) == 4096  # the flag always wins


def test_encoder_landing_pool_flag_and_the_gpus_that_read_it(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu", "--encoder-workers", "1")
    assert build_config(parse(*base)).encoder_landing_mb == 0  # encoders on the model's device: shared memory
    assert build_config(parse(*base, "--encoder-landing-mb", "4096")).encoder_landing_mb == 4096
    with pytest.raises(SystemExit, match="--encoder-landing-mb"):
        build_config(parse(*base, "--encoder-landing-mb", "-1"))
    # The pool of an encoder of replica r is read by that replica's model ranks, on GPUs r * tp ..
    config = build_config(parse(*base))
    cuda = replace(config, engine=replace(config.engine, device="cuda", tp_size=2), dp_size=2)
    assert (cuda.lm_devices(0), cuda.lm_devices(1)) == ([0, 1], [2, 3])


def test_encode_ahead_flag_and_what_it_refuses(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu")
    assert build_config(parse(*base)).engine.encode_ahead_tokens == 0
    assert build_config(parse(*base, "--encode-ahead-tokens", "4096")).engine.encode_ahead_tokens == 4096
    for bad, why in [(("-1",), "must be 0"), (("512", "--tp", "2"), "needs --tp 1"),
                     (("512", "--encoder-workers", "1"), "needs --tp 1 .* and no --encoder-workers")]:
        with pytest.raises(SystemExit, match=f"^glimpse serve: --encode-ahead-tokens {why}"):
            build_config(parse(*base, "--encode-ahead-tokens", *bad))


def test_image_cap_defaults_by_model_kind_and_takes_the_flag(
    demo_model_dir: Path, qwen3_5_model_dir: Path, gemma4_model_dir: Path, qwen3_moe_model_dir: Path,
    gemma4_moe_model_dir: Path,
) -> None:
    # Dense attention-only models keep the cap that bounds decodes' stalls behind images; MoE and hybrid models
    # (recurrent state) serve without it by default (it cost them 6-21% of (b)'s requests/s), and the flag wins.
    for model, default in [(demo_model_dir, 2048), (gemma4_model_dir, 2048), (qwen3_5_model_dir, 0),
                           (qwen3_moe_model_dir, 0), (gemma4_moe_model_dir, 0)]:
        base = ("--model", str(model), "--device", "cpu")
        assert build_config(parse(*base)).engine.decode_step_image_tokens == default, model
        assert build_config(parse(*base, "--decode-step-image-tokens", "4096")).engine.decode_step_image_tokens == 4096
        assert build_config(parse(*base, "--decode-step-image-tokens", "0")).engine.decode_step_image_tokens == 0


def test_a_negative_encode_token_cost_is_refused(demo_model_dir: Path) -> None:
    with pytest.raises(SystemExit, match="^glimpse serve: --encode-token-cost must be >= 0"):
        build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--encode-token-cost", "-1"))
    assert build_config(parse("--model", str(demo_model_dir), "--device", "cpu", "--encode-token-cost", "0.5")
                        ).engine.encode_token_cost == 0.5


def test_the_vit_plan_budget_reaches_the_config_and_a_negative_one_is_refused(demo_model_dir: Path) -> None:
    base = ("--model", str(demo_model_dir), "--device", "cpu")
    assert build_config(parse(*base)).engine.vit_plan_cache_mb == 64
    assert build_config(parse(*base, "--vit-plan-cache-mb", "0")).engine.vit_plan_cache_mb == 0
    with pytest.raises(SystemExit, match="^glimpse serve: --vit-plan-cache-mb must be 0"):
        build_config(parse(*base, "--vit-plan-cache-mb", "-1"))
