"""The scheduling core with encoder workers (``remote_encodes``): images requested at admission, chunks that wait
for an image to land, plans that import landed entries instead of encoding, and who unlinks what when."""

from __future__ import annotations

from ipc.prompts import MMItem, SamplingParams
from ipc.shm import ShmRef
from ipc.steps import StepPlan, StepResult
from workers.engine.core.scheduler import SchedulerCore

WIDTH = 10  # bytes per embedding token


def core(**overrides: object) -> tuple[SchedulerCore, list[str]]:
    """A core with encoder workers, and the landing names it asked to unlink."""
    args: dict[str, object] = dict(
        num_blocks=64, block_size=4, chunk_size=64, max_num_seqs=8, max_model_len=512, mm_cache_bytes=10_000,
        embedding_bytes_per_token=WIDTH, eos_token_ids=(99,), enable_prefix_caching=False, remote_encodes=True,
    )
    args.update(overrides)
    c = SchedulerCore(**args)  # type: ignore[arg-type]
    unlinked: list[str] = []
    assert c.remote is not None
    c.remote.on_unlink = unlinked.extend
    return c, unlinked


def item(tag: int, offset: int, length: int) -> MMItem:
    pixels = ShmRef(f"px-{tag}", 4 * length, "float32", (length, 1))
    return MMItem(bytes([tag]) * 16, offset, length, (1, 2, 2 * length), pixels)


def landing(tag: int, rows: int) -> ShmRef:
    return ShmRef(f"emb-{tag}", rows * WIDTH, "uint8", (rows, WIDTH))


def add(c: SchedulerCore, rid: str, n: int, items: list[MMItem], pending: tuple[bytes, ...] = ()) -> None:
    c.add(rid, [1] * n, 0, items, SamplingParams(max_tokens=2, temperature=0), pending=pending)


def step(c: SchedulerCore) -> StepPlan:
    plan = c.schedule()
    assert plan is not None
    c.update(StepResult(plan.step_id, [(ch.rid, 5) for ch in plan.chunks if ch.sample]))
    return plan


def test_images_are_requested_at_admission_and_chunks_wait_for_them() -> None:
    c, unlinked = core()
    a, b = item(1, 4, 8), item(2, 20, 8)
    add(c, "r", 40, [a, b])
    plan = step(c)
    assert c.remote is not None
    assert [job.key for job in c.remote.drain()] == [a.hash, b.hash]  # both at once, ahead of their chunks
    assert [(ch.start, ch.length) for ch in plan.chunks] == [(0, 4)] and not plan.encode and not plan.mm_import
    assert c.schedule() is None  # nothing to do until an image lands
    assert c.remote.done(b.hash, landing(2, 8), 8) == []  # out of order: a still blocks the chunk
    assert c.schedule() is None
    assert c.remote.done(a.hash, landing(1, 8), 8) == []
    plan = step(c)
    assert [(ch.start, ch.length) for ch in plan.chunks] == [(4, 36)]
    assert [(i.key, i.embeddings.name, i.rows, i.transient) for i in plan.mm_import] == [
        (a.hash, "emb-1", 8, False), (b.hash, "emb-2", 8, False),
    ]
    assert not plan.encode and a.hash in c.mm_index and b.hash in c.mm_index
    assert not c.remote.landed and unlinked == []  # consumed: the scheduler unlinks them after the step
    # The same image again: a cache hit, nothing requested or imported.
    add(c, "again", 12, [item(1, 2, 8)])
    while c.has_work():
        plan = step(c)
        assert not plan.mm_import and not plan.encode
    assert c.remote.drain() == [] and c.remote.stats.fallbacks == 0


def test_a_transient_entry_stays_landed_for_every_chunk_then_goes_with_its_request() -> None:
    c, unlinked = core(mm_cache_bytes=5 * WIDTH, chunk_size=8)  # the cache cannot hold the 12-token image
    img = item(3, 2, 12)
    add(c, "r", 20, [img])
    step(c)
    assert c.remote is not None and len(c.remote.drain()) == 1
    c.remote.done(img.hash, landing(3, 12), 12)
    imports = [step(c).mm_import for _ in range(2)]  # two chunks read the image: each imports it, transient
    assert [[(i.key, i.transient) for i in imp] for imp in imports] == [[(img.hash, True)]] * 2
    assert img.hash in c.remote and unlinked == []
    while c.has_work():
        step(c)
    assert unlinked == ["emb-3"] and not c.remote.landed


def test_an_ended_request_leaves_no_landing_segment_and_failures_name_their_waiters() -> None:
    c, unlinked = core()
    x, y = item(4, 4, 8), item(5, 4, 8)
    add(c, "gone", 20, [x])
    add(c, "bad", 20, [y])
    step(c)
    assert c.remote is not None and len(c.remote.drain()) == 2
    c.abort("gone")  # its encode is in flight: its segment goes when it lands
    assert c.remote.done(x.hash, landing(4, 8), 8) == [] and unlinked == ["emb-4"]
    assert c.remote.failed(y.hash) == ["bad"]
    # A wrong answer (rows of another size) fails its waiters too, and its segment goes at once.
    add(c, "odd", 20, [item(6, 4, 8)])
    c.abort("bad")
    step(c)
    [job] = c.remote.drain()
    assert c.remote.done(job.key, landing(6, 7), 7) == ["odd"] and unlinked == ["emb-4", "emb-6"]


def test_pixels_still_being_written_are_requested_once_they_land() -> None:
    c, _ = core()
    first, later = item(7, 4, 8), item(8, 20, 8)
    add(c, "r", 40, [first, later], pending=(later.hash,))
    step(c)
    assert c.remote is not None and [j.key for j in c.remote.drain()] == [first.hash]
    c.media_ready("r", [later.hash])
    assert [j.key for j in c.remote.drain()] == [later.hash]
