"""KV-cache events without a server: the wire layout vLLM consumers decode (arrays, tag first, three ZMQ
frames), and what the scheduling core publishes: stored blocks with the keys the prefix cache uses and
the images they cover, and removals when a cached block is recycled."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import zmq

from ipc.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    KVEventPublisher,
    block_removed,
    block_stored,
    external_hash,
    replica_endpoint,
)
from ipc.prompts import MMItem, SamplingParams
from ipc.steps import StepResult
from workers.engine.core.kv_cache import block_hashes
from workers.engine.core.scheduler import SchedulerCore
from workers.scheduler.kv_events import KVEventRecorder

BS = 4


class Collect:
    endpoint = "test"

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self._decoder = msgspec.msgpack.Decoder(list[KVEvent])

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.batches.append(self._decoder.decode(msgspec.msgpack.encode(events)))  # as a subscriber reads them

    def events(self) -> list[KVEvent]:
        return [e for batch in self.batches for e in batch]


def run(core: SchedulerCore, recorder: KVEventRecorder) -> None:
    while (plan := core.schedule()) is not None:
        core.update(StepResult(plan.step_id, [(c.rid, 7) for c in plan.chunks if c.sample]))
        recorder.flush()


def test_the_wire_layout_is_vllms_array_form() -> None:
    stored = block_stored([1, 2], None, list(range(8)), 4, "GPU", [[("ab" * 16, 0)], None])
    batch = KVEventBatch(12.5, [stored, block_removed([2], "GPU"), AllBlocksCleared()], 1)  # type: ignore[list-item]
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))  # what a schema-less decoder sees
    assert raw == [
        12.5,
        [
            ["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU", None, [[["ab" * 16, 0]], None]],
            ["BlockRemoved", [2], "GPU"],
            ["AllBlocksCleared"],
        ],
        1,
    ]
    # Without an image, the short form (no extra_keys: 8 elements, what fixed-size decoders expect), which
    # decoders that know the field read as absent.
    text = block_stored([1], 5, [1, 2], 2, "GPU", [None])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(text)) == ["BlockStored", [1], 5, [1, 2], 2, None, "GPU", None]
    decoded = msgspec.msgpack.Decoder(KVEvent).decode(msgspec.msgpack.encode(text))
    assert decoded == BlockStored([1], 5, [1, 2], 2, None, "GPU", None, None)
    # A hybrid model's events name their group (vLLM's group_idx and kv_cache_spec_kind, after extra_keys).
    grouped = block_stored([1], 5, [1, 2], 2, "GPU", [None], (1, "mamba"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(grouped)) == [
        "BlockStored", [1], 5, [1, 2], 2, None, "GPU", None, [None], 1, "mamba"
    ]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(block_removed([3], "GPU", 1))) == ["BlockRemoved", [3], "GPU", 1]


def test_replicas_get_consecutive_ports() -> None:
    assert replica_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert replica_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert replica_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_batches_are_three_frames_with_a_big_endian_sequence(tmp_path: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address = f"ipc://{tmp_path}/kv.sock"
    pub = KVEventPublisher(ctx, address, "kv@pod@demo", replica=0)  # ipc: bound by the publisher
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(address)
    try:
        frames: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while len(frames) < 2 and time.monotonic() < deadline:  # PUB drops until the subscription is in
            pub.publish([AllBlocksCleared()])
            if sub.poll(50):
                frames.append(sub.recv_multipart())
        assert len(frames) == 2
        (topic, seq, payload), (_, seq2, _) = frames
        assert topic == b"kv@pod@demo" and len(seq) == 8 and int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
        assert msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events == [AllBlocksCleared()]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()


def test_stored_blocks_carry_the_prefix_keys_and_their_images() -> None:
    core = SchedulerCore(
        num_blocks=8, block_size=BS, chunk_size=64, max_num_seqs=4, max_model_len=64, mm_cache_bytes=1 << 20,
        embedding_bytes_per_token=4, eos_token_ids=(0,),
    )
    sink = Collect()
    recorder = KVEventRecorder(sink, BS, "CPU").attach(core)  # type: ignore[arg-type]
    a, b = MMItem(b"\x0a" * 16, 2, 5, (1, 2, 5)), MMItem(b"\x0b" * 16, 7, 3, (1, 2, 3))
    prompt = list(range(1, 14))
    core.add("r", prompt, 0, [a, b], SamplingParams(max_tokens=2, ignore_eos=True))
    recorder.flush()
    run(core, recorder)
    events = sink.events()
    assert events[0] == AllBlocksCleared()  # a fresh cache first
    stored = [e for e in events if isinstance(e, BlockStored)]
    keys = block_hashes([*prompt, 7, 7], BS, items=[a, b])
    assert [h for e in stored for h in e.block_hashes] == [external_hash(k) for k in keys]
    assert stored[0].parent_block_hash is None
    assert [t for e in stored for t in e.token_ids] == [*prompt, 7, 7][: len(keys) * BS]
    extra = [x for e in stored for x in (e.extra_keys or [None] * len(e.block_hashes))]
    # Block 0 [0, 4) starts image a at offset 2; block 1 [4, 8) is inside a (offset 2) and starts b.
    assert extra[:3] == [[(a.hash.hex(), 0)], [(a.hash.hex(), 2), (b.hash.hex(), 0)], [(b.hash.hex(), 1)]]

    # Another prompt needs every block: the cached ones are recycled, and announced as removed.
    core.add("s", list(range(50, 75)), 0, [], SamplingParams(max_tokens=1))
    run(core, recorder)
    removed = [h for e in sink.events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) >= {external_hash(k) for k in keys[:3]}


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
    core.add("s", list(range(50, 75)), 0, [], SamplingParams(max_tokens=1))
    run(core, recorder)
    removed = [e for e in sink.events() if isinstance(e, BlockRemoved)]
    assert {h for e in removed if e.group_idx == 1 for h in e.block_hashes} == {external_hash(keys[1]), external_hash(keys[2])}
    assert {h for e in removed if e.group_idx == 0 for h in e.block_hashes} >= {external_hash(k) for k in keys}
