"""The eager step's index tensors (one packed host-to-device copy) each start on a 16-byte boundary. Triton
compiles a kernel once per alignment class of its pointers: fields whose offsets followed the batch size made the
paged decode kernel compile two more variants in the middle of a fresh server's first load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ipc.prompts import SamplingParams
from tests.workers.engine.runner.test_async_scheduling import make_engine
from tests.workers.engine.test_offline import chat, noise_image
from workers.engine.kernels.attention import AttentionMetadata
from workers.engine.runner.batching import aligned_pack, aligned_split, host_tensor, int_array


@pytest.mark.parametrize(("dtype", "per_16_bytes", "packed_len"), [(torch.int32, 4, 4 + 4 + 8 + 4), (torch.int64, 2, 2 + 4 + 6 + 2)])
def test_packed_parts_come_back_whole_and_aligned(dtype: torch.dtype, per_16_bytes: int, packed_len: int) -> None:
    parts = [[1], [2, 3, 4], [], [5, 6, 7, 8, 9], [10, 11]]
    packed = aligned_pack(parts, per_16_bytes, dtype)
    assert packed.dtype == dtype and packed.data_ptr() % 16 == 0
    views = aligned_split(packed, parts, per_16_bytes)
    assert [v.tolist() for v in views] == parts
    assert all(v.data_ptr() % 16 == 0 for v in views)
    assert len(packed) == packed_len  # each part rounded up to whole 16 bytes, the empty one taking none


def test_every_steps_metadata_is_aligned_whatever_the_batch(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir, async_scheduling=True, chunk_size=24)
    seen: list[AttentionMetadata] = []

    def record(_module: Any, args: tuple[Any, ...]) -> None:
        seen.append(args[3])

    engine.runner.lm.register_forward_pre_hook(record)
    requests = [chat("Describe the picture.", [noise_image(64, 48, 1)])] + [
        [{"role": "user", "content": f"Count to {i}."}] for i in range(2, 7)
    ]
    engine.generate(requests, [SamplingParams(max_tokens=6, temperature=0.0)] * len(requests))
    batches = {len(m.seq_lens_cpu) for m in seen}
    # Batches whose fields the old packing left unaligned: (batch + 1) int32 starts put the lengths off 16 bytes.
    assert {b for b in batches if (b + 1) % 4} and len(seen) > 5
    for meta in seen:
        for field in (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping):
            assert field.data_ptr() % 16 == 0, (len(meta.seq_lens_cpu), field)


def test_host_tensors_take_lists_or_arrays_of_either_width() -> None:
    assert host_tensor([]).shape == (0,) and host_tensor([], torch.int32).dtype == torch.int32
    big = [2**40, -3, 0]
    assert host_tensor(big).tolist() == big
    filled = int_array(torch.int32)
    filled.extend([7, -8, 2**31 - 1])
    assert host_tensor(filled, torch.int32).tolist() == [7, -8, 2**31 - 1]
    with pytest.raises(OverflowError):  # an id too wide for int32 is an error, not a wrapped index
        host_tensor([2**31], torch.int32)
    with pytest.raises(ValueError, match="per_16_bytes"):
        aligned_pack([[1]], 32)
