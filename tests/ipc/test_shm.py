"""Shared-memory segments: real /dev/shm files, real mappings, a real second process."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import msgspec
import pytest
import torch

from ipc.launch import new_launch_id, shm_prefix
from ipc.shm import (
    SHM_DIR,
    ShmError,
    ShmFullError,
    ShmRef,
    ShmSegment,
    list_segments,
    segment_name,
    sweep,
    sweep_dead_launches,
)


@pytest.fixture
def launch_id() -> Iterator[str]:
    """A fresh launch id; the test fails if it leaves any segment of that launch behind."""
    lid = new_launch_id()
    yield lid
    leftovers = list_segments(lid)
    sweep(lid)  # clean up even on failure, so one broken test does not leak into /dev/shm
    assert leftovers == [], f"test leaked shm segments: {leftovers}"


def _digest(t: torch.Tensor) -> str:
    # Bytes via a uint8 view: works for dtypes numpy lacks (bfloat16).
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _child_checksum(encoded_ref: bytes) -> tuple[str, list[int], str]:
    """Runs in a spawned process: attach by ref (as received off the wire) and hash the pixels."""
    ref = msgspec.msgpack.decode(encoded_ref, type=ShmRef)
    with ShmSegment.attach(ref) as seg:
        t = seg.tensor()
        return _digest(t), list(t.shape), str(t.dtype)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 224, 224, dtype=torch.float32),
        torch.randint(0, 256, (1080, 1920, 3), dtype=torch.uint8),
        torch.randn(17, 5).to(torch.bfloat16),
    ],
    ids=["float32", "uint8-1080p", "bfloat16"],
)
def test_round_trip(launch_id: str, tensor: torch.Tensor) -> None:
    name = segment_name(launch_id, "img0")
    seg, ref = ShmSegment.create_from_tensor(name, tensor)
    try:
        assert ref == ShmRef(name, tensor.nbytes, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        assert os.path.getsize(os.path.join(SHM_DIR, name)) == tensor.nbytes
        with ShmSegment.attach(ref) as reader:
            view = reader.tensor()
            assert view.dtype == tensor.dtype and view.shape == tensor.shape
            assert torch.equal(view, tensor)
    finally:
        seg.close()
        assert ShmSegment.unlink(name)


def test_attach_is_zero_copy_and_isolated(launch_id: str) -> None:
    name = segment_name(launch_id, "zc")
    seg, ref = ShmSegment.create_from_tensor(name, torch.zeros(4096, dtype=torch.float32))
    try:
        reader = ShmSegment.attach(ref)
        view = reader.tensor()
        # The producer writes after the reader mapped: the reader sees it, so nothing was copied.
        seg.tensor()[10] = 42.0
        assert view[10].item() == 42.0
        # A stray in-place op on the reader's side stays private (copy-on-write): it neither
        # crashes nor corrupts the producer's pixels.
        view[20] = -1.0
        assert seg.tensor()[20].item() == 0.0
        reader.close()
    finally:
        seg.close()
        ShmSegment.unlink(name)


def test_attach_does_not_warn(launch_id: str) -> None:
    seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, "w"), torch.ones(8))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ShmSegment.attach(ref) as reader:
                assert reader.tensor().sum().item() == 8.0
    finally:
        seg.close()
        ShmSegment.unlink(ref.name)


def test_read_from_separate_process(launch_id: str) -> None:
    tensor = torch.randint(0, 256, (1080, 1920, 3), dtype=torch.uint8)
    seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, "xproc"), tensor)
    seg.close()  # the producer may detach before the consumer attaches: the name keeps it alive
    try:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            digest, shape, dtype = pool.submit(_child_checksum, msgspec.msgpack.encode(ref)).result(timeout=120)
        assert digest == _digest(tensor)
        assert shape == [1080, 1920, 3] and dtype == "torch.uint8"
    finally:
        ShmSegment.unlink(ref.name)


def test_view_outlives_close(launch_id: str) -> None:
    seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, "life"), torch.arange(1000.0))
    reader = ShmSegment.attach(ref)
    view = reader.tensor()[10:20]
    reader.close()
    seg.close()
    ShmSegment.unlink(ref.name)
    # Closed and unlinked, yet the view is still backed by the mapping it keeps alive.
    assert view.sum().item() == sum(range(10, 20))
    with pytest.raises(ShmError, match="closed"):
        reader.tensor()


def test_full_shm_raises_and_leaves_no_file(launch_id: str) -> None:
    st = os.statvfs(SHM_DIR)
    if st.f_blocks == 0 or st.f_blocks * st.f_frsize >= 10**15:
        # An unlimited tmpfs would try to back the request page by page instead of refusing it.
        pytest.skip("/dev/shm has no size limit below 1 PB")
    name = segment_name(launch_id, "huge")
    with pytest.raises(ShmFullError):
        ShmSegment.create(name, 10**15)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_create_is_exclusive(launch_id: str) -> None:
    name = segment_name(launch_id, "dup")
    with ShmSegment.create(name, 64), pytest.raises(FileExistsError):
        ShmSegment.create(name, 64)
    ShmSegment.unlink(name)


def test_unlink_idempotent(launch_id: str) -> None:
    name = segment_name(launch_id, "u")
    seg, ref = ShmSegment.create_from_tensor(name, torch.ones(3))
    seg.close()
    assert ShmSegment.unlink(name) is True
    assert ShmSegment.unlink(name) is False
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach(ref)


def test_sweep_only_own_launch(launch_id: str) -> None:
    # An id extending ours: its names start with our id but not with our "-"-terminated prefix.
    other = launch_id + "ff"
    try:
        for lid in (launch_id, other):
            for i in range(3):
                ShmSegment.create(segment_name(lid, f"s{i}"), 128).close()
        assert list_segments(launch_id) == [segment_name(launch_id, f"s{i}") for i in range(3)]
        assert sweep(launch_id) == 3
        assert list_segments(launch_id) == []
        assert len(list_segments(other)) == 3
        assert sweep(launch_id) == 0
        assert sweep(other) == 3
        assert list_segments(other) == []
    finally:
        sweep(other)


def test_errors(launch_id: str) -> None:
    name = segment_name(launch_id, "err")
    seg, ref = ShmSegment.create_from_tensor(name, torch.ones(4, 4))
    try:
        with pytest.raises(ShmError, match="bytes"):
            seg.write_tensor(torch.ones(5, 5))
        with ShmSegment.attach(ref) as reader:
            with pytest.raises(ShmError, match="read-only"):
                reader.write_tensor(torch.ones(4, 4))
            with pytest.raises(ShmError, match="inconsistent"):
                reader.tensor(ShmRef(name, 64, "float32", (3, 3)))
            with pytest.raises(ShmError, match="unknown dtype"):
                reader.tensor(ShmRef(name, 64, "Tensor", (16,)))
        with pytest.raises(ShmError, match="holds"):
            ShmSegment.attach(ShmRef(name, 1 << 20, "uint8", (1 << 20,)))
        with pytest.raises(ValueError):
            ShmSegment.create("../etc/evil", 8)
        with pytest.raises(ValueError):
            shm_prefix("")
    finally:
        seg.close()
        ShmSegment.unlink(name)


def test_strided_and_empty_tensors(launch_id: str) -> None:
    src = torch.arange(24, dtype=torch.int64).view(4, 6).t()  # non-contiguous
    seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, "strided"), src)
    seg.close()
    with ShmSegment.attach(ref) as reader:
        assert torch.equal(reader.tensor(), src)
    ShmSegment.unlink(ref.name)

    seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, "empty"), torch.empty(0, 3))
    seg.close()
    with ShmSegment.attach(ref) as reader:
        assert reader.tensor().shape == (0, 3)
    ShmSegment.unlink(ref.name)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped), so nothing owns it now."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_dead_launches_removes_only_launches_whose_owner_is_gone() -> None:
    from ipc.launch import cleanup_launch_dir, ipc_address, launch_dir

    dead, alive, handmade = new_launch_id(owner_pid=_dead_pid()), new_launch_id(), "handmade0123"
    try:
        for lid in (dead, alive, handmade):
            seg, _ = ShmSegment.create_from_tensor(segment_name(lid, "x-1"), torch.ones(4))
            seg.close()
            ipc_address(lid, "sched")  # creates the launch's socket directory
        removed = sweep_dead_launches()
        assert removed.get(dead) == 1
        assert list_segments(dead) == [] and not os.path.exists(launch_dir(dead))
        # This process owns `alive`; a hand-made id names no owner: both are left alone.
        assert len(list_segments(alive)) == 1 and len(list_segments(handmade)) == 1
        assert os.path.isdir(launch_dir(alive)) and alive not in removed and handmade not in removed
    finally:
        for lid in (dead, alive, handmade):
            sweep(lid)
            cleanup_launch_dir(lid)
