"""The host tiers' memory (pinned_host.py): plain tensors on the CPU path; on CUDA a huge-page mapping faulted in by
threads, then registered, and unregistered when the tier goes."""

from __future__ import annotations

import pytest
import torch

from workers.engine.runner import pinned_host
from workers.engine.runner.pinned_host import pinned_host_memory, unpin


def _resident_pages(buffer: torch.Tensor) -> int:
    """How many of ``buffer``'s base pages are in memory (mincore over the mapping)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pages = -(-buffer.numel() // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()), vec) == 0
    return sum(v & 1 for v in vec)


def test_the_cpu_path_is_a_plain_tensor_of_the_size() -> None:
    memory = pinned_host_memory(3 << 20, False, "embedding host tier", "--mm-host-cache-mb")
    assert memory.dtype == torch.uint8 and memory.shape == (3 << 20,)
    with pytest.raises(ValueError, match="embedding host tier: a host buffer needs a positive size"):
        pinned_host_memory(0, False, "embedding host tier", "--mm-host-cache-mb")


def test_every_page_is_faulted_in_before_registration_and_reads_as_zeros() -> None:
    nbytes = (37 << 20) + 4096 * 3 + 100  # pages that do not split evenly among the threads, and a partial last one
    buffer = pinned_host._huge_page_mapping(nbytes)
    assert buffer.shape == (nbytes,) and _resident_pages(buffer) < -(-nbytes // 4096)  # nothing touched yet
    pinned_host._fault_in(buffer)
    assert _resident_pages(buffer) == -(-nbytes // 4096)
    assert not buffer.any()
    buffer[-1] = 7  # writable to its last byte, and the mapping stays alive with the tensor
    view = buffer[-8:].clone()
    del buffer
    assert view.tolist() == [0] * 7 + [7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pins_the_mapping_and_copies_from_it_asynchronously() -> None:
    memory = pinned_host_memory(64 << 20, True, "KV host tier", "--kv-host-cache-mb", pinned_host.HOST_REGISTER_MAPPED)
    assert memory.is_pinned()  # registered: CUDA knows the pages as page-locked host memory
    memory[:4096].copy_(torch.arange(4096).remainder(251).to(torch.uint8))
    device = torch.empty(4096, dtype=torch.uint8, device="cuda")
    device.copy_(memory[:4096], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), memory[:4096])
    unpin(memory)
    assert not memory.is_pinned()
