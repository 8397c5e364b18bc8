"""The landing union (ipc/landing.py) through the real decoders of the sockets that carry it: an encoder's answer
(scheduler inbound), a plan's imports (model inbound) and a release (encoder inbound), each variant decoded as
itself; a segment landing is still a ``ShmRef`` for the code that maps it, and pixel pointers keep their untagged
encoding."""

from __future__ import annotations

import msgspec

from ipc.encode import EncodeDone, EncodeRelease
from ipc.inbound import EncoderInbound, ModelInbound, SchedulerInbound
from ipc.landing import (
    CudaLanding,
    CudaPoolHandle,
    LandingRef,
    NixlLanding,
    ShmLanding,
    cuda_landing_name,
    is_pool_landing,
    nixl_landing_name,
)
from ipc.shm import ShmRef
from ipc.steps import EmbeddingImport, EncodeItem, StepPlan

POOL = CudaPoolHandle(1, bytes(range(64)), 4 << 30, 2 << 20, b"/torch_123_456_0", 3, b"\x07" * 64, True)
CUDA = CudaLanding(cuda_landing_name(2, 0x1F), 2, POOL, 256 * 9, 1280 * 8192, "bfloat16", (1280, 4096))
SHM = ShmLanding("glimpse-x-emb-ab", 1280 * 8192, "bfloat16", (1280, 4096))
NIXL = NixlLanding(nixl_landing_name(1, 0x2A), 1, "glimpse-x-e1", b"\x00meta" * 90, "VRAM", 3, 0x7F00_0000_1000,
                   1280 * 8192, "bfloat16", (1280, 4096))


def round_trip(msg: object, union: object) -> object:
    return msgspec.msgpack.Decoder(union).decode(msgspec.msgpack.Encoder().encode(msg))


def test_encode_done_carries_each_landing() -> None:
    for ref in (CUDA, SHM, NIXL):
        done = EncodeDone(2, b"k" * 16, 1280, ref)
        back = round_trip(done, SchedulerInbound)
        assert back == done and type(back) is EncodeDone
        assert type(back.embeddings) is type(ref)
    assert isinstance(SHM, ShmRef)  # ShmSegment.attach and the shm code paths take it unchanged


def test_a_plan_imports_every_kind_in_order() -> None:
    imports = [EmbeddingImport(b"a" * 16, CUDA, 1280), EmbeddingImport(b"b" * 16, SHM, 1280, transient=True),
               EmbeddingImport(b"c" * 16, NIXL, 1280)]
    plan = StepPlan(4, [], [], [], [], [], mm_import=imports)
    back = round_trip(plan, ModelInbound)
    assert back == plan
    assert [type(imp.embeddings) for imp in back.mm_import] == [CudaLanding, ShmLanding, NixlLanding]
    assert back.mm_import[0].embeddings.pool == POOL


def test_release_and_names() -> None:
    rel = EncodeRelease([CUDA.name, cuda_landing_name(2, 0x20)])
    assert round_trip(rel, EncoderInbound) == rel
    assert is_pool_landing(CUDA.name) and is_pool_landing(NIXL.name) and not is_pool_landing(SHM.name)
    assert nixl_landing_name(2, 0x1F) != cuda_landing_name(2, 0x1F)
    assert cuda_landing_name(2, 0x1F) != cuda_landing_name(3, 0x1F)


def test_pixel_pointers_stay_untagged() -> None:
    item = EncodeItem(b"h" * 16, (1, 4, 4), 4, ShmRef("glimpse-x-px", 64, "float32", (4, 4)))
    assert b"via" not in msgspec.msgpack.encode(item)
    decoded: LandingRef = msgspec.msgpack.decode(msgspec.msgpack.encode(SHM), type=LandingRef)
    assert decoded == SHM
