"""Typed ZMQ channels and launch naming: real sockets over ipc://, real spawned processes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from ipc.channels import (
    ZERO_COPY_BYTES,
    AsyncPubSocket,
    AsyncPullSocket,
    AsyncPushSocket,
    AsyncSubSocket,
    Poller,
    PubSocket,
    PullSocket,
    PushSocket,
    SubSocket,
    new_async_context,
    new_context,
)
from ipc.control import AbortRequest
from ipc.inbound import TokenizerInbound
from ipc.launch import cleanup_launch_dir, ipc_address, launch_dir, new_launch_id
from ipc.requests import GenerateRequest, RouteRequest
from ipc.shm import ShmRef, segment_name

# ---- a small tagged-union protocol, defined at module level so spawned children can decode it --


class Ping(msgspec.Struct, frozen=True, tag=True):
    seq: int


class Work(msgspec.Struct, frozen=True, tag=True):
    rid: str
    image: ShmRef
    token_ids: list[int]


class Stop(msgspec.Struct, frozen=True, tag=True):
    reason: str = ""


Msg = Ping | Work | Stop


class Echo(msgspec.Struct, frozen=True):
    """A single-Struct channel type wrapping the union: what a child saw, and who it is."""

    worker: int
    msg: Msg


HANDSHAKE = -1
TIMEOUT_MS = 20_000


def _work(launch_id: str) -> Work:
    ref = ShmRef(segment_name(launch_id, "0123456789abcdef0123456789abcdef-0"), 1080 * 1920 * 3, "uint8", (1080, 1920, 3))
    return Work(rid="0" * 32, image=ref, token_ids=[151652, 151655, 151653])


# ---- children (spawned) -------------------------------------------------------------------------


def _pull_echo_child(work_addr: str, result_addr: str) -> None:
    """Pull every message, echo it back; stop after Stop."""
    ctx = new_context()
    pull = PullSocket[Msg](ctx, work_addr, Msg, bind=False)
    push = PushSocket(ctx, result_addr, Echo, bind=False)
    push.send(Echo(0, Ping(HANDSHAKE)))  # ready ack: the parent sends only after this arrives
    while True:
        msg = pull.recv(TIMEOUT_MS)
        if msg is None:
            break
        push.send(Echo(0, msg))
        if isinstance(msg, Stop):
            break
    pull.close()
    push.close(linger_ms=5_000)  # the last echo must get out before the process exits
    ctx.term()


def _sub_echo_child(worker: int, plan_addr: str, ack_addr: str) -> None:
    """Subscribe to the plan broadcast and echo everything seen, tagged with our worker index."""
    ctx = new_context()
    sub = SubSocket[Msg](ctx, plan_addr, Msg, bind=False)
    push = PushSocket(ctx, ack_addr, Echo, bind=False)
    while True:
        msg = sub.recv(TIMEOUT_MS)
        if msg is None:
            break
        push.send(Echo(worker, msg))
        if isinstance(msg, Stop):
            break
    sub.close()
    push.close(linger_ms=5_000)
    ctx.term()


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def launch_id() -> Iterator[str]:
    lid = new_launch_id()
    yield lid
    cleanup_launch_dir(lid)
    assert not os.path.exists(launch_dir(lid))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context = new_context()
    yield context
    context.destroy(linger=0)  # closes any socket a failing test left open, so term cannot hang


def _spawn(target: Callable[..., None], *args: object) -> multiprocessing.process.BaseProcess:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _join(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0


# ---- launch naming ------------------------------------------------------------------------------


def test_launch_naming(launch_id: str) -> None:
    # The id names its owner (this process, in this pid namespace) and stays short for socket paths.
    assert re.fullmatch(rf"p{os.getpid()}n[0-9a-f]+_[0-9a-f]{{8}}", launch_id) and len(launch_id) <= 32
    assert new_launch_id() != launch_id
    addr = ipc_address(launch_id, "tokenizer-in")
    assert addr == f"ipc:///tmp/glimpse-{launch_id}/tokenizer-in.sock"
    assert len(addr.removeprefix("ipc://").encode()) <= 107
    mode = os.stat(launch_dir(launch_id)).st_mode
    assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700
    for bad in ("", "../x", "a/b"):
        with pytest.raises(ValueError):
            ipc_address(launch_id, bad)
    with pytest.raises(ValueError):
        ipc_address("../../etc", "x")
    cleanup_launch_dir(launch_id)
    cleanup_launch_dir(launch_id)  # idempotent


# ---- sync ---------------------------------------------------------------------------------------


def test_push_pull_between_processes(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    work_addr, result_addr = ipc_address(launch_id, "work"), ipc_address(launch_id, "result")
    results = PullSocket(ctx, result_addr, Echo, bind=True)
    work = PushSocket[Msg](ctx, work_addr, Msg, bind=True)
    proc = _spawn(_pull_echo_child, work_addr, result_addr)
    try:
        assert results.recv(TIMEOUT_MS) == Echo(0, Ping(HANDSHAKE))
        sent: list[Msg] = [Ping(1), _work(launch_id), Ping(2), Stop("done")]
        for msg in sent:
            work.send(msg)
        got = [results.recv(TIMEOUT_MS) for _ in sent]
        assert got == [Echo(0, m) for m in sent]
        assert isinstance(got[1], Echo) and isinstance(got[1].msg, Work)
        assert got[1].msg.image.shape == (1080, 1920, 3)
    finally:
        _join(proc)
        work.close()
        results.close()


def test_pub_sub_between_processes(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    plan_addr, ack_addr = ipc_address(launch_id, "plan"), ipc_address(launch_id, "ack")
    acks = PullSocket(ctx, ack_addr, Echo, bind=True)
    plan = PubSocket[Msg](ctx, plan_addr, Msg, bind=True)
    procs = [_spawn(_sub_echo_child, i, plan_addr, ack_addr) for i in range(2)]
    try:
        # PUB drops messages for subscribers that have not joined yet: publish handshakes until
        # every subscriber has echoed one (what the launcher's ready acks do for real).
        joined: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while joined != {0, 1}:
            assert time.monotonic() < deadline, "subscribers never joined"
            plan.send(Ping(HANDSHAKE))
            while (echo := acks.recv(50)) is not None:
                joined.add(echo.worker)
        sent: list[Msg] = [Ping(7), _work(launch_id), Stop()]
        for msg in sent:
            plan.send(msg)
        seen: dict[int, list[Msg]] = {0: [], 1: []}
        while not all(s and isinstance(s[-1], Stop) for s in seen.values()):
            echo = acks.recv(TIMEOUT_MS)
            assert echo is not None, "timed out waiting for echoes"
            if echo.msg != Ping(HANDSHAKE):  # late handshakes may still be in flight
                seen[echo.worker].append(echo.msg)
        assert seen == {0: sent, 1: sent}
    finally:
        for proc in procs:
            _join(proc)
        plan.close()
        acks.close()


def test_sync_sockets_carry_a_payload_frame(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The synchronous sockets split and join a large ``payload_field`` as the asyncio ones do (a test's stand-in
    tokenizer receives what the frontend sends; benchmarks send bodies from a thread)."""
    addr = ipc_address(launch_id, "sync-payload")
    with PullSocket[TokenizerInbound](ctx, addr, TokenizerInbound, bind=True) as pull, \
            PushSocket[TokenizerInbound](ctx, addr, TokenizerInbound, bind=False) as push:
        bodies = [os.urandom(3 << 20), b"{}"]
        for i, body in enumerate(bodies):
            push.send(GenerateRequest(f"s{i}", memoryview(body), 1.0))
        for i, body in enumerate(bodies):
            got = pull.recv(TIMEOUT_MS)
            assert isinstance(got, GenerateRequest) and got.rid == f"s{i}" and got.body == body
        push._sock.send_multipart([push.encode(AbortRequest("x")), b"stray"])
        with pytest.raises(ValueError, match="AbortRequest arrived with frames"):
            pull.recv(TIMEOUT_MS)


def test_recv_timeout_returns_none(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with PullSocket[Msg](ctx, ipc_address(launch_id, "idle"), Msg, bind=True) as pull:
        assert pull.recv(0) is None
        start = time.monotonic()
        assert pull.recv(100) is None
        assert time.monotonic() - start >= 0.09
    assert pull.closed


def test_wrong_type_fails_at_the_boundary(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    addr = ipc_address(launch_id, "typed")
    pull = PullSocket(ctx, addr, Echo, bind=True)
    push = PushSocket[Msg](ctx, addr, Msg, bind=False)
    push.send(Stop())
    with pytest.raises(msgspec.ValidationError):
        pull.recv(TIMEOUT_MS)
    push.close()
    pull.close()


def test_poller(launch_id: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    a_addr, b_addr = ipc_address(launch_id, "a"), ipc_address(launch_id, "b")
    a, b = PullSocket[Msg](ctx, a_addr, Msg, bind=True), PullSocket[Msg](ctx, b_addr, Msg, bind=True)
    push_b = PushSocket[Msg](ctx, b_addr, Msg, bind=False)
    poller = Poller()
    poller.register(a)
    poller.register(b)
    assert poller.poll(0) == []
    push_b.send(Ping(3))
    assert poller.poll(TIMEOUT_MS) == [b]
    assert b.recv(0) == Ping(3)
    poller.unregister(a)
    for s in (push_b, a, b):
        s.close()


def test_shm_ref_message_is_tiny(launch_id: str) -> None:
    msg = _work(launch_id)
    encoded = msgspec.msgpack.Encoder().encode(msg)
    assert len(encoded) < 200, len(encoded)
    assert msgspec.msgpack.Decoder(Msg).decode(encoded) == msg


# ---- asyncio ------------------------------------------------------------------------------------


@contextlib.contextmanager
def bound_and_connected(launch_id: str, name: str, bound: Any, connected: Any) -> Iterator[tuple[Any, Any]]:
    """Asyncio sockets of ``Msg`` on endpoint ``name``: one of class ``bound`` binds it, one of ``connected`` connects;
    both closed, last made first, and their context ended when the test is done with them."""
    actx = new_async_context()
    addr = ipc_address(launch_id, name)
    first = bound[Msg](actx, addr, Msg, bind=True)
    second = connected[Msg](actx, addr, Msg, bind=False)
    try:
        yield first, second
    finally:
        second.close()
        first.close()
        actx.term()


@pytest.mark.asyncio
async def test_async_push_pull(launch_id: str) -> None:
    with bound_and_connected(launch_id, "async", AsyncPullSocket, AsyncPushSocket) as (pull, push):
        sent: list[Msg] = [*(Ping(i) for i in range(50)), _work(launch_id), Stop()]
        for msg in sent:
            await push.send(msg)
        assert [await pull.recv() for _ in sent] == sent
        assert await pull.recv(50) is None


@pytest.mark.asyncio
async def test_async_pub_sub(launch_id: str) -> None:
    with bound_and_connected(launch_id, "apub", AsyncPubSocket, AsyncSubSocket) as (pub, sub):
        async with asyncio.timeout(TIMEOUT_MS / 1000):
            while True:  # slow-joiner handshake, as in the sync test
                await pub.send(Ping(HANDSHAKE))
                if await sub.recv(50) is not None:
                    break
            await pub.send(Stop("bye"))
            while (msg := await sub.recv()) == Ping(HANDSHAKE):
                pass
        assert msg == Stop("bye")


@pytest.mark.asyncio
async def test_large_messages_go_zero_copy_and_arrive_whole(launch_id: str) -> None:
    """Messages past ZERO_COPY_BYTES are sent without a copy and every asyncio receive decodes straight from ZeroMQ's
    buffer: a chat body of megabytes arrives byte for byte, in order with small messages, and a Raw field (a routed
    request) stays valid after the frame it was decoded from is gone."""
    actx = new_async_context()
    addr = ipc_address(launch_id, "big")
    pull = AsyncPullSocket[TokenizerInbound](actx, addr, TokenizerInbound, bind=True)
    push = AsyncPushSocket[TokenizerInbound](actx, addr, TokenizerInbound, bind=False)
    raw_addr = ipc_address(launch_id, "raw")
    raw_pull = AsyncPullSocket(actx, raw_addr, RouteRequest, bind=True)
    raw_push = AsyncPushSocket(actx, raw_addr, RouteRequest, bind=False)
    try:
        bodies = [os.urandom(size) for size in (8 << 20, 10, ZERO_COPY_BYTES, ZERO_COPY_BYTES - 1, 3 << 20)]
        for i, body in enumerate(bodies):
            await push.send(GenerateRequest(f"r{i}", memoryview(body), float(i), "completion" if i else "chat"))
        for i, body in enumerate(bodies):
            got = await pull.recv()
            assert isinstance(got, GenerateRequest) and got.rid == f"r{i}" and got.body == body
            assert got.arrival == float(i) and got.endpoint == ("completion" if i else "chat")
            # Read where ZeroMQ put it: a large body in a frame of its own, a small one inside the message's frame.
            assert isinstance(got.body, memoryview) and isinstance(got.body.obj, zmq.Frame)
            assert (got.body.obj.buffer.nbytes == len(body)) == (len(body) >= ZERO_COPY_BYTES)
        # A frame after a message whose type takes none is a protocol error, not a silently dropped payload.
        await push._sock.send_multipart([push.encode(AbortRequest("x")), b"stray"])
        with pytest.raises(ValueError, match="AbortRequest arrived with frames"):
            await pull.recv()
        inner = msgspec.msgpack.encode(GenerateRequest("inner", memoryview(os.urandom(2 << 20)), 0.0))
        await raw_push.send(RouteRequest("inner", 1, [], [], msgspec.Raw(inner)))
        routed = await raw_pull.recv()
        gc.collect()  # the frame object is gone; the Raw must still hold its bytes
        assert bytes(routed.request) == inner
    finally:
        for sock in (push, pull, raw_push, raw_pull):
            sock.close()
        actx.term()
