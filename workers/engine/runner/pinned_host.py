"""Page-locked host memory for the host tiers (host_embeddings.py, host_kv.py), taken once at start-up.

The memory is plain anonymous memory that CUDA registers (cudaHostRegister), not torch's pinned allocator, which
rounds each request up to a power of two: for a budget of 8 GiB and its slack it would lock 16.

Registering locks every page, and a page the process has not touched yet is first faulted in and zeroed by the
kernel, 4 KiB at a time, on the registering thread: 3.6-4.8 s for the 8.5 GiB embedding tier of the Qwen3-VL-8B
harness's flags, every start (H200 host, 16 cores). Here the mapping asks for transparent huge pages (2 MiB: 512x
fewer faults; honoured where the host's THP mode is "madvise" or "always") and threads fault the pages in before the
registration, which then only locks pages that are there: 0.37 s for the same 8.5 GiB on the same host (0.9 s
without huge pages, 1.9 s with huge pages but no threads).
"""

from __future__ import annotations

import mmap
import os
import threading

import torch
from torch import Tensor

HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the pages get a device address (the host one, under UVA)
_FAULT_THREADS = 16  # past the host's cores they only wait on one another
_PAGE = 4096  # one write per base page faults it in (a huge page takes the first and the rest are present)


def pinned_host_memory(nbytes: int, pin: bool, what: str, flag: str, flags: int = 0) -> Tensor:
    """``nbytes`` of host memory as a uint8 tensor; with ``pin`` (a CUDA process), page-locked with
    cudaHostRegister ``flags``. A registration CUDA refuses raises a RuntimeError naming ``what`` and the ``flag``
    that sizes it. Unpinned memory (the CPU path) is a plain tensor: nothing copies from it asynchronously."""
    if nbytes <= 0:
        raise ValueError(f"{what}: a host buffer needs a positive size, not {nbytes}")
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    buffer = _huge_page_mapping(nbytes)
    _fault_in(buffer)
    if (rc := int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, flags))) != 0:
        raise RuntimeError(f"pinning {nbytes >> 20} MiB for the {what} failed (cudaError {rc}): lower {flag}")
    return buffer


def unpin(buffer: Tensor) -> None:
    """Undo the registration (before the memory goes: callers hold ``buffer`` until this ran)."""
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _huge_page_mapping(nbytes: int) -> Tensor:
    """An anonymous private mapping with the huge-page hint where the platform has it. The tensor holds a reference
    to the mapping (torch.frombuffer), so it is unmapped only when the last view of it goes."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel built without THP: base pages, faulted in all the same
            pass
    return torch.frombuffer(region, dtype=torch.uint8)


def _fault_in(buffer: Tensor) -> None:
    """Touch one byte of every page, the pages split among threads (torch's ops release the GIL, and the kernel
    zeroes each thread's pages on that thread's core)."""
    threads = max(1, min(_FAULT_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    span = -(-buffer.numel() // threads // _PAGE) * _PAGE  # whole pages per thread
    pages = [buffer[i : i + span][::_PAGE] for i in range(0, buffer.numel(), span)]
    workers = [threading.Thread(target=p.zero_, name="fault-in") for p in pages[1:]]
    for w in workers:
        w.start()
    pages[0].zero_()
    for w in workers:
        w.join()
