"""KV-cache events without a server: the wire layout vLLM 0.24 consumers decode (arrays outside, events as maps
tagged under "type"; the older all-array layout behind a flag), the one publisher every replica's batches go
through (one stream, one sequence, vLLM's replay), and what the scheduling core publishes, checked the way
llm-d's indexer uses it: block keys recomputed from the events' tokens and media identifiers equal the keys
computed from the request (tests/llmd_index.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from ipc.kv_event_publisher import END_SEQ, KVEventPublisher, KVEventSender, default_topic
from ipc.kv_events import (
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    block_removed,
    block_stored,
    external_hash,
)
from ipc.launch import cleanup_launch_dir, new_launch_id
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepResult
from tests.llmd_index import Index, decode_batch
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.scheduler import SchedulerCore
from workers.scheduler.kv_events import KVEventRecorder

BS = 4
IMAGE_ID, VIDEO_ID = 151655, 151656


class Collect:
    """A sink that encodes each batch as a replica would and decodes it as a subscriber does."""

    endpoint = "test"

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self.raw: list[list[dict[str, Any]]] = []
        self._encoder = BatchEncoder("map", replica=0)
        self._decoder = msgspec.msgpack.Decoder(list[KVEvent])

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.batches.append(self._decoder.decode(msgspec.msgpack.encode(events)))
        self.raw.append(decode_batch(self._encoder.encode(events))[1])  # strictly, vLLM 0.24's layout

    def close(self, linger_ms: int = 0) -> None:
        pass

    def events(self) -> list[KVEvent]:
        return [e for batch in self.batches for e in batch]


def run(core: SchedulerCore, recorder: KVEventRecorder) -> None:
    while (plan := core.schedule()) is not None:
        core.update(StepResult(plan.step_id, [(c.rid, 7) for c in plan.chunks if c.sample]))
        recorder.flush()


def test_the_wire_layout_is_vllm_024s_and_the_array_layout_is_the_older_one() -> None:
    stored = block_stored([1, 2], None, list(range(8)), 4, "GPU", [[("cat-1", 2)], None])
    events: list[KVCacheEvent] = [stored, block_removed([2], "GPU"), AllBlocksCleared()]
    ts, raw, rank = decode_batch(BatchEncoder("map", 1).encode(events))
    assert rank == 1 and ts > 0
    assert raw == [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [[["cat-1", 2]], None]},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    # Text only: no extra_keys at all; a hybrid model's group fields when named.
    text = block_stored([1], 5, [1, 2], 2, "GPU", [None], (1, "mamba"))
    [ev] = decode_batch(BatchEncoder("map", 0).encode([text]))[1]
    assert "extra_keys" not in ev and (ev["group_idx"], ev["kv_cache_spec_kind"]) == (1, "mamba")
    # --kv-events-layout array: vLLM <= 0.23's positional events, trailing unset fields left off.
    array = msgspec.msgpack.decode(BatchEncoder("array", 1).encode([*events, text]))
    assert array[1:] == [[
        ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU", None, [[["cat-1", 2]], None]],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
        ["BlockStored", [1], 5, [1, 2], 2, None, "GPU", None, None, 1, "mamba"],
    ], 1]
    with pytest.raises(ValueError):
        BatchEncoder("json", 0)  # type: ignore[arg-type]


def test_the_default_topic_names_the_pod_endpoint_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_topic("10.1.2.3", 8000, "qwen") == "kv@10.1.2.3:8000@qwen"
    monkeypatch.setenv("POD_IP", "10.9.9.9")
    assert default_topic("0.0.0.0", 8001, "m") == "kv@10.9.9.9:8001@m"


@pytest.fixture
def launch() -> Iterator[str]:
    lid = new_launch_id()
    yield lid
    cleanup_launch_dir(lid)


def test_replicas_share_one_stream_and_a_gap_is_replayed(launch: str, tmp_path: Path) -> None:
    """Two replicas' senders, one publisher: one topic, one consecutive sequence with both ranks in it; a
    subscriber that missed batches gets them again, topic included, from vLLM's replay socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_addr, replay_addr = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    publisher = KVEventPublisher(ctx, launch, pub_addr, "kv@pod:1@demo", replay_addr, buffer_steps=4).start()
    senders = [KVEventSender(ctx, launch), KVEventSender(ctx, launch)]
    encoders = [BatchEncoder("map", 0), BatchEncoder("map", 1)]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub_addr)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_addr)
    try:
        live: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while not live and time.monotonic() < deadline:  # PUB drops until the subscription is in
            senders[0].send(encoders[0].encode([AllBlocksCleared()]))
            if sub.poll(50):
                live.append(sub.recv_multipart())
        assert live
        for i in range(6):  # interleaved, as two schedulers send
            senders[i % 2].send(encoders[i % 2].encode([block_removed([i], "CPU")]))
        while len(live) < 7 and sub.poll(2000):
            live.append(sub.recv_multipart())
        first = int.from_bytes(live[0][1], "big")
        seqs = [int.from_bytes(f[1], "big") for f in live]
        assert seqs == list(range(first, first + 7)) and {f[0] for f in live} == {b"kv@pod:1@demo"}
        assert sorted(decode_batch(f[2])[2] for f in live[1:]) == [0, 0, 0, 1, 1, 1]  # type: ignore[type-var]

        # A subscriber that saw up to seqs[3] asks for the rest: the buffer (4 batches) still has them.
        dealer.send_multipart([b"", seqs[4].to_bytes(8, "big")])
        replayed = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and frames[1] == b"kv@pod:1@demo"
            if frames[2] == END_SEQ:
                assert frames[3] == b""
                break
            replayed.append(frames[1:])
        assert replayed == [f for f in live[4:]]
        # From before what the buffer keeps: what it has (the subscriber sees the first seq is not its own).
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        older = []
        while dealer.poll(5000) and (frames := dealer.recv_multipart())[2] != END_SEQ:
            older.append(int.from_bytes(frames[2], "big"))
        assert older == seqs[-4:]
    finally:
        for s in senders:
            s.close()
        publisher.stop(linger_ms=0)
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def test_a_multi_image_chat_matches_every_block_the_way_llm_d_keys_it() -> None:
    """Two images (one with the client's uuid) and a video of two frame groups: every full block of the prompt
    keyed from the request (real media token ids; per block the identifiers of the media it overlaps) is one
    llm-d indexed from the events, and neither glimpse's pad values nor another identifier would match."""
    core = SchedulerCore(
        num_blocks=16, block_size=BS, chunk_size=64, max_num_seqs=4, max_model_len=64, mm_cache_bytes=1 << 20,
        embedding_bytes_per_token=4, eos_token_ids=(0,),
    )
    sink = Collect()
    recorder = KVEventRecorder(sink, BS, "CPU", (IMAGE_ID, VIDEO_ID)).attach(core)
    a = MMItem(b"\x0a" * 16, 2, 5, (1, 2, 5), uuid="cat-1")
    b = MMItem(b"\x0b" * 16, 7, 3, (1, 2, 3))
    g0 = MMItem(b"\x0c" * 16, 14, 4, (1, 2, 4), frame=(0, 0))
    g1 = MMItem(b"\x0d" * 16, 20, 4, (1, 2, 4), frame=(1, 2))  # tokens 18-19: the text between the groups
    items = [a, b, g0, g1]
    prompt = list(range(1, 30))
    for it in items:  # glimpse's prompts carry a pad value per image, as the processor writes them
        prompt[it.offset : it.offset + it.length] = [900_000 + it.hash[0]] * it.length
    core.add("r", prompt, 0, items, SamplingParams(max_tokens=2, ignore_eos=True))
    recorder.flush()
    run(core, recorder)

    index = Index(BS, "demo")
    for batch in sink.raw:
        for ev in batch:
            index.apply(ev)
    rendered = list(prompt)  # vLLM's render of the same request: the real media token ids
    for it in items:
        rendered[it.offset : it.offset + it.length] = [IMAGE_ID if it.frame is None else VIDEO_ID] * it.length
    media = [("cat-1", 2, 5), (b.hash.hex(), 7, 3), (g0.hash.hex(), 14, 10)]  # a video is one item
    keys = index.request_keys(rendered, media)
    assert len(keys) == len(prompt) // BS == 7
    assert [k in index.keys for k in keys] == [True] * 7
    assert not set(index.request_keys(prompt, media)[:1]) & index.keys  # pad values: no match from block 0 on
    wrong = [(a.hash.hex(), 2, 5), *media[1:]]
    assert not set(index.request_keys(rendered, wrong)) & index.keys  # the content hash where the uuid was given
    by_frame = [*media[:2], (g0.hash.hex(), 14, 4), (g1.hash.hex(), 20, 4)]
    assert not set(index.request_keys(rendered, by_frame)[5:]) & index.keys  # a video named per frame group

    stored = [e for e in sink.events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [external_hash(k) for k in block_hashes([*prompt, 7, 7], BS, items=items)]
    extra = [x for e in stored for x in (e.extra_keys or [None] * len(e.block_hashes))]
    # (identifier, where the item starts relative to the block), as vLLM keys a block; a video is one item.
    bh, vh = b.hash.hex(), g0.hash.hex()
    assert extra[:7] == [[("cat-1", 2)], [("cat-1", -2), (bh, 3)], [(bh, -1)], [(vh, 2)], [(vh, -2)], [(vh, -6)], None]

    # Another prompt needs every block: the cached ones are recycled, announced, and gone from the index.
    seen = len(sink.raw)
    core.add("s", list(range(50, 112)), 0, [], SamplingParams(max_tokens=1))  # 62 + 1 tokens: all 16 blocks
    run(core, recorder)
    for batch in sink.raw[seen:]:
        for ev in batch:
            index.apply(ev)
    removed = {h for e in sink.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert {external_hash(k) for k in block_hashes(prompt, BS, items=items)[:3]} <= removed
    assert not set(keys[:3]) & index.keys


def test_a_hybrid_model_publishes_its_blocks_and_its_state_snapshots_as_two_groups() -> None:
    """As vLLM does for hybrid models: the attention layers' blocks in group 0 ("full_attention"), the blocks a state
    snapshot ends (where a prefix hit can resume) in group 1 ("mamba"); each group's removals name it."""
    core = SchedulerCore(
        num_blocks=8, block_size=BS, chunk_size=64, max_num_seqs=4, max_model_len=64, mm_cache_bytes=1 << 20,
        embedding_bytes_per_token=4, eos_token_ids=(0,), state_slots=4, state_snapshot_every=2,
    )
    sink = Collect()
    recorder = KVEventRecorder(sink, BS, "CPU").attach(core)  # type: ignore[arg-type]
    prompt = list(range(1, 14))  # 13 tokens: snapshots at 8 (every 2 blocks) and 12 (the last full block)
    core.add("r", prompt, 0, [], SamplingParams(max_tokens=2, ignore_eos=True))
    run(core, recorder)
    stored = [e for e in sink.events() if isinstance(e, BlockStored)]
    keys = block_hashes(prompt, BS)
    kv = [h for e in stored if e.group_idx == 0 for h in e.block_hashes]
    assert kv == [external_hash(k) for k in keys] and {e.kv_cache_spec_kind for e in stored if e.group_idx == 0} == {"full_attention"}
    state = [e for e in stored if e.group_idx == 1]
    assert [e.block_hashes for e in state] == [[external_hash(keys[1])], [external_hash(keys[2])]]
    assert [e.parent_block_hash for e in state] == [external_hash(keys[0]), external_hash(keys[1])]
    assert state[1].token_ids == prompt[8:12] and {e.kv_cache_spec_kind for e in state} == {"mamba"}

    # A prompt that needs every block recycles the cached ones: their snapshots go with them, each group announced.
    core.add("s", list(range(50, 81)), 0, [], SamplingParams(max_tokens=1))  # 31 + 1 tokens: all 8 blocks
    run(core, recorder)
    removed = [e for e in sink.events() if isinstance(e, BlockRemoved)]
    assert {h for e in removed if e.group_idx == 1 for h in e.block_hashes} == {external_hash(keys[1]), external_hash(keys[2])}
    assert {h for e in removed if e.group_idx == 0 for h in e.block_hashes} >= {external_hash(k) for k in keys}


def test_the_host_tier_publishes_its_blocks_under_medium_cpu() -> None:
    """A GPU replica with the prefix cache's host tier: a block spilled before its device block is reused is stored
    again under medium CPU (same hash, parent and tokens, so llm-d chains it), a host slot given to another key removes
    it under CPU, and a block loaded back is stored on the GPU again. After every prompt an llm-d-style indexer's
    longest prefix of each prompt is the one this replica's tiers hold, and it indexes no key that no tier holds."""
    core = SchedulerCore(
        num_blocks=8, block_size=BS, chunk_size=64, max_num_seqs=4, max_model_len=64, mm_cache_bytes=1 << 20,
        embedding_bytes_per_token=4, eos_token_ids=(0,), kv_host_slots=4,
    )
    host = core.allocator.host
    assert host is not None
    sink = Collect()
    recorder = KVEventRecorder(sink, BS, "GPU").attach(core)
    index = Index(BS, "demo")
    prompts = {"a": list(range(1, 14)), "b": list(range(50, 75)), "a2": [*range(1, 14), 90, 91, 92, 93, 94],
               "c": list(range(100, 125)), "d": list(range(200, 225))}
    for rid, prompt in prompts.items():
        seen = len(sink.raw)
        core.add(rid, prompt, 0, [], SamplingParams(max_tokens=1, ignore_eos=True))
        run(core, recorder)
        for batch in sink.raw[seen:]:
            for ev in batch:
                index.apply(ev)
        for tokens in prompts.values():
            keys = block_hashes(tokens, BS)
            held = [core.allocator.lookup(k) is not None or host.contains(k) for k in keys]
            indexed = [k in index.keys for k in index.request_keys(tokens, [])[: len(keys)]]
            # llm-d scores the longest indexed prefix: it must be the prefix this replica can serve, and no key it
            # indexes may be one that no tier holds any more.
            assert prefix_length(indexed) == prefix_length(held), rid
            assert not [i for i, (x, h) in enumerate(zip(indexed, held, strict=True)) if x and not h], rid

    events = sink.events()
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    gpu_stored = {h: e for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert 0 < len(cpu_stored) <= host.spills  # a spill whose parent left both tiers is unreachable: not published
    for e in cpu_stored:  # the GPU store's block again: its tokens and its parent
        (h,) = e.block_hashes
        first = gpu_stored[h]
        i = first.block_hashes.index(h)
        assert e.token_ids == first.token_ids[i * BS : (i + 1) * BS]
        assert e.parent_block_hash == (first.block_hashes[i - 1] if i else first.parent_block_hash)
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)  # a host slot went to another key
    assert host.loads > 0  # "a2" resumed from the host tier


def prefix_length(flags: list[bool]) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))
