"""The frontend -> tokenizer hop of a chat body: a GenerateRequest from an asyncio PUSH to an asyncio PULL in another
process, through ``ipc/channels.py`` as the server sends it. Latency from before the send to the decoded message (one
host clock), bodies ``--gap-ms`` apart, each a fresh object as the HTTP server hands one over. Run it with an older
tree first on PYTHONPATH to compare.

    python -m benchmarks.request_path.body_hop_bench --mb 0.8,6.7 --count 30
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import msgspec
import uvloop

import ipc
from ipc.channels import AsyncPullSocket, AsyncPushSocket, new_async_context
from ipc.requests import GenerateRequest


def _receive(address: str, count: int, ready: Any, out: Any) -> None:
    async def main() -> None:
        ctx = new_async_context()
        sock = AsyncPullSocket(ctx, address, GenerateRequest, bind=True)
        ready.put(True)
        lat = []
        for _ in range(count):
            msg = await sock.recv()
            lat.append(time.monotonic() - msg.arrival)
        out.put(lat)
        sock.close()
        ctx.term()

    uvloop.run(main())


def _send(address: str, size: int, count: int, gap_s: float) -> None:
    as_view = msgspec.structs.fields(GenerateRequest)[1].type is memoryview  # older trees take bytes

    async def main() -> None:
        ctx = new_async_context()
        sock = AsyncPushSocket(ctx, address, GenerateRequest, bind=False)
        body = os.urandom(size)
        for i in range(count):
            await asyncio.sleep(gap_s)
            fresh = bytearray(body)
            fresh[0] = i % 256
            data = bytes(fresh)
            t = time.monotonic()
            await sock.send(GenerateRequest(f"r{i}", memoryview(data) if as_view else data, t))  # type: ignore[arg-type]
        sock.close(linger_ms=5000)
        ctx.term()

    uvloop.run(main())


def hop_ms(size: int, count: int, gap_s: float) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/hop"
        ready: Any = mp.Queue()
        out: Any = mp.Queue()
        receiver = mp.Process(target=_receive, args=(address, count, ready, out))
        receiver.start()
        ready.get(timeout=30)
        sender = mp.Process(target=_send, args=(address, size, count, gap_s))
        sender.start()
        lat = out.get(timeout=60 + count * gap_s * 2)
        sender.join(30)
        receiver.join(30)
    return [1e3 * v for v in lat[2:]]  # the first two pay the processes' first allocations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="0.8,6.7", help="body sizes in MB, comma-separated")
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=200.0)
    args = ap.parse_args()
    print(f"tree: {os.path.dirname(os.path.dirname(ipc.__file__))}")
    print("\n| body MB | hop ms median | min | max |\n|---|---|---|---|")
    for mb in (float(v) for v in args.mb.split(",")):
        lat = hop_ms(int(mb * 1e6), args.count, args.gap_ms / 1e3)
        print(f"| {mb:g} | {statistics.median(lat):.2f} | {min(lat):.2f} | {max(lat):.2f} |")


if __name__ == "__main__":
    main()
