"""An encoder worker's entry crossing to a model rank, by transport: a shared-memory segment (the encoder writes
it, the rank maps it and copies the rows out) against the NIXL pool (the encoder copies into its registered pool,
the rank reads the range with one NIXL READ into its registered staging buffer and copies the rows out). Two real
processes, as in a server; median of ``--reps`` entries per size, in ms. On CUDA the entries start on the encoder's
GPU and end on the reader's.

    python -m benchmarks.request_path.landing_bench --sizes-mb 8,64 --reps 10
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import msgspec
import torch

from benchmarks.args import parser
from ipc.landing import LandingRef, NixlLanding, ShmLanding
from ipc.launch import new_launch_id
from ipc.shm import ShmSegment, segment_name, sweep


def encoder_side(launch_id: str, device: str, pool_mb: int, jobs: Any, out: Any) -> None:
    """Land each asked size both ways; answer (refs, landing ms each); free the previous round's first."""
    from workers.encoder.nixl_landing import open_nixl_pool

    pool = open_nixl_pool(0, torch.device(device), pool_mb << 20, launch_id)
    serial = 0
    while (job := jobs.get()) is not None:
        nbytes, done = job
        pool.release(done)
        entry = torch.randn(nbytes // 2 // 4096, 4096, device=device).to(torch.bfloat16)
        start = time.perf_counter()
        seg, ref = ShmSegment.create_from_tensor(segment_name(launch_id, f"land{serial}"), entry.to("cpu").contiguous())
        seg.close()
        shm_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        nixl = pool.land(entry)
        nixl_ms = (time.perf_counter() - start) * 1e3
        serial += 1
        shm = ShmLanding(ref.name, ref.nbytes, ref.dtype, ref.shape)
        out.put((msgspec.msgpack.encode(shm), msgspec.msgpack.encode(nixl), shm_ms, nixl_ms))
    pool.close()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes-mb", default="8,64", help="entry sizes (MiB); a 1080p Qwen3-VL-8B entry is ~64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from workers.engine.runner.nixl_reader import NixlReader

    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    lid, ctx = new_launch_id(), mp.get_context("spawn")
    jobs, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=encoder_side, args=(lid, args.device, 2 * max(sizes) + 1, jobs, out))
    child.start()
    reader, device = NixlReader(torch.device(args.device)), torch.device(args.device)
    print(f"entry crossing on {args.device}, median of {args.reps} (ms)\n")
    print("| MiB | shm: land | shm: read + copy | shm total | NIXL: land | NIXL: read + copy | NIXL total |")
    print("|---|---|---|---|---|---|---|")
    try:
        done: list[str] = []
        for mb in sizes:
            times: dict[str, list[float]] = {k: [] for k in ("shm land", "shm read", "nixl land", "nixl read")}
            for _ in range(args.reps + 1):  # the first of each size warms the paths and is dropped
                jobs.put((mb << 20, done))
                raw_shm, raw_nixl, shm_ms, nixl_ms = out.get(timeout=120)
                shm, nixl = (msgspec.msgpack.decode(r, type=LandingRef) for r in (raw_shm, raw_nixl))
                assert isinstance(shm, ShmLanding) and isinstance(nixl, NixlLanding)
                start = time.perf_counter()
                with ShmSegment.attach(shm) as seg:
                    a = seg.tensor(shm).to(device, copy=True)
                ShmSegment.unlink(shm.name)
                shm_read = (time.perf_counter() - start) * 1e3
                start = time.perf_counter()
                b = reader.rows(nixl).to(device, copy=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                nixl_read = (time.perf_counter() - start) * 1e3
                assert torch.equal(a, b)
                done = [nixl.name]
                for key, value in zip(times, (shm_ms, shm_read, nixl_ms, nixl_read)):
                    times[key].append(value)
            med = {k: statistics.median(v[1:]) for k, v in times.items()}
            print(f"| {mb} | {med['shm land']:.2f} | {med['shm read']:.2f} | {med['shm land'] + med['shm read']:.2f} | "
                  f"{med['nixl land']:.2f} | {med['nixl read']:.2f} | {med['nixl land'] + med['nixl read']:.2f} |")
    finally:
        jobs.put(None)
        child.join(30)
        if child.is_alive():
            child.kill()
        reader.close()
        sweep(lid)


if __name__ == "__main__":
    main()
