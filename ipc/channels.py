"""Typed ZMQ sockets: one message type (a Struct or a tagged union of Structs) per socket.

Every message is one msgpack frame encoded by msgspec; decoding validates against the socket's
type, so a peer speaking the wrong protocol fails loudly at the boundary. Messages are small by
design (pixels travel as ShmRef pointers), hence single frames and copying sends, which are faster than
zero-copy for payloads under a few tens of KB; the exception is a chat body on its way to a tokenizer
(megabytes of data URLs), so large sends and the asyncio receives are zero-copy, and a message type may name a
``payload_field`` (a ``memoryview``) that a sender puts in a frame of its own when it is large.

Pattern choice (kept deliberately small):
- Push/Pull: work queues (frontend -> tokenizers load-balanced, tokenizers -> scheduler fan-in,
  ranks -> scheduler results).
- Pub/Sub: one plan to every TP rank. HWM 0 makes PUB queue rather than drop for a slow rank;
  note PUB still drops for subscribers that have not connected yet (the launcher's ready acks
  close that window).

Typing: for a single Struct the type parameter is inferred (`PullSocket(ctx, a, Req, ...)`).
Unions are not classes to mypy, so name T explicitly: `PullSocket[Msg](ctx, a, Msg, ...)`.
"""

from __future__ import annotations

from typing import Any, Generic, Self, TypeVar, cast, overload

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")
# Messages this large are sent zero-copy: ZeroMQ reads the encoded bytes (immutable) in place instead of copying
# them first. A chat body with eight 1080p data URLs (6.7 MB) took ~20 ms to reach its tokenizer with a copy at each
# end, ~4 ms without (2-core box). Below pyzmq's own copy threshold a copy is cheaper than the zero-copy
# bookkeeping.
ZERO_COPY_BYTES = 1 << 16

__all__ = [
    "AsyncPubSocket",
    "AsyncPullSocket",
    "AsyncPushSocket",
    "AsyncSubSocket",
    "Poller",
    "PubSocket",
    "PullSocket",
    "PushSocket",
    "SubSocket",
    "new_async_context",
    "new_context",
]


def new_context() -> zmq.Context[zmq.Socket[bytes]]:
    """A ZMQ context for the sync sockets; create one per process, after fork/spawn."""
    return zmq.Context()


def new_async_context() -> zmq.asyncio.Context:
    """A ZMQ context for the asyncio sockets (frontend, async loops)."""
    return zmq.asyncio.Context()


def _configure(sock: zmq.Socket[Any], address: str, bind: bool, hwm: int) -> None:
    # HWM 0 = unbounded: control messages are tiny and dropping or blocking on one (a plan, a
    # finished request) would wedge the pipeline; back-pressure lives in the shm byte budget.
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # Local ipc:// transport by default; tcp addresses should not resolve to v6 surprises.
    sock.setsockopt(zmq.IPV6, 0)
    # Linger is applied at close() time; until then let queued messages flush normally.
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)


class _Channel(Generic[T]):
    """Holds the socket, the reusable encoder/decoder and the close logic."""

    _kind: int

    def __init__(self, sock: zmq.Socket[Any], address: str, msg_type: Any, bind: bool, hwm: int) -> None:
        self.address = address
        self.msg_type = msg_type
        self._sock = sock
        # One encoder/decoder per socket: msgspec caches per-type plans inside these objects.
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)
        try:
            if self._kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            _configure(sock, address, bind, hwm)
        except BaseException:
            sock.close(linger=0)
            raise

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)

    def _split(self, msg: T) -> list[Any] | None:
        """[head, payload] for a message whose ``payload_field`` holds at least ZERO_COPY_BYTES, sent as two frames with
        the payload in place: msgpack would copy it once here (0.6-3 ms for a 6.7 MB chat body on the 2-core box) and
        the receiver once more. None: one frame."""
        field: str = getattr(type(msg), "payload_field", "")
        payload = getattr(msg, field) if field else None
        if payload is None or len(payload) < ZERO_COPY_BYTES:
            return None
        return [self._encoder.encode(msgspec.structs.replace(cast(msgspec.Struct, msg), **{field: memoryview(b"")})),
                payload]

    def _attach(self, msg: T, payload: zmq.Frame) -> T:
        """``msg`` with the frame that followed it (the last of its message) in its ``payload_field``."""
        field: str = getattr(type(msg), "payload_field", "")
        if not field:
            raise ValueError(f"{type(msg).__name__} arrived with frames it does not take")
        if payload.more:
            raise ValueError(f"{type(msg).__name__} arrived with more frames than a payload")
        return cast(T, msgspec.structs.replace(cast(msgspec.Struct, msg), **{field: payload.buffer}))

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; idempotent. linger 0 drops unsent messages so shutdown never hangs
        on a dead peer; pass a linger when the last sends must get out (e.g. a final result)."""
        if not self._sock.closed:
            self._sock.close(linger=linger_ms)


# ---- sync --------------------------------------------------------------------------------------


class _SyncChannel(_Channel[T]):
    _sock: zmq.Socket[bytes]

    # Two overloads: a Struct class lets mypy infer T; a Union (not a class to mypy) needs T
    # spelled out by the caller as Socket[Msg](...).
    @overload
    def __init__(
        self, ctx: zmq.Context[Any], address: str, msg_type: type[T], bind: bool, *, hwm: int = 0
    ) -> None: ...
    @overload
    def __init__(self, ctx: zmq.Context[Any], address: str, msg_type: Any, bind: bool, *, hwm: int = 0) -> None: ...

    def __init__(self, ctx: zmq.Context[Any], address: str, msg_type: Any, bind: bool, *, hwm: int = 0) -> None:
        super().__init__(ctx.socket(self._kind), address, msg_type, bind, hwm)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SyncSender(_SyncChannel[T]):
    def send(self, msg: T) -> None:
        """Queue `msg`; blocks only while the socket has no peer to route to (PUSH, bound side)."""
        parts = self._split(msg)
        if parts is not None:
            self._sock.send_multipart(parts, copy=False)
            return
        self.send_bytes(self._encoder.encode(msg))

    def send_bytes(self, data: bytes) -> None:
        """Queue a message the caller already encoded as a T (one StepPlan encoded once, then sent to
        every TP rank). Not validated here: the receiving socket's decoder still checks it."""
        self._sock.send(data, 0, copy=len(data) < ZERO_COPY_BYTES)


class _SyncReceiver(_SyncChannel[T]):
    @overload
    def recv(self) -> T: ...
    @overload
    def recv(self, timeout_ms: int) -> T | None: ...

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Next message; with `timeout_ms`, None if nothing arrived in time (0 = non-blocking)."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        msg = self._decoder.decode(self._sock.recv(copy=True))
        if self._sock.getsockopt(zmq.RCVMORE):  # a payload frame (see send): already here with its message
            msg = self._attach(msg, self._sock.recv(copy=False))
        return msg


class PushSocket(_SyncSender[T]):
    """Sends T to pull peers, round-robin across them."""

    _kind = zmq.PUSH


class PullSocket(_SyncReceiver[T]):
    """Receives T fairly queued from all push peers."""

    _kind = zmq.PULL


class PubSocket(_SyncSender[T]):
    """Broadcasts T to every connected subscriber."""

    _kind = zmq.PUB


class SubSocket(_SyncReceiver[T]):
    """Receives every T its publisher sends (subscribed to all topics)."""

    _kind = zmq.SUB


class Poller:
    """Wait on several receiving sockets at once (the scheduler reads requests and results)."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._by_sock: dict[zmq.Socket[Any], _SyncReceiver[Any]] = {}

    def register(self, channel: _SyncReceiver[Any]) -> None:
        self._poller.register(channel._sock, zmq.POLLIN)
        self._by_sock[channel._sock] = channel

    def unregister(self, channel: _SyncReceiver[Any]) -> None:
        self._poller.unregister(channel._sock)
        del self._by_sock[channel._sock]

    def poll(self, timeout_ms: int | None = None) -> list[_SyncReceiver[Any]]:
        """Channels with at least one message ready; None waits forever, 0 returns at once."""
        return [self._by_sock[s] for s, _ in self._poller.poll(timeout_ms)]


# ---- asyncio -----------------------------------------------------------------------------------


class _AsyncChannel(_Channel[T]):
    _sock: zmq.asyncio.Socket

    # Two overloads: a Struct class lets mypy infer T; a Union (not a class to mypy) needs T
    # spelled out by the caller as Socket[Msg](...).
    @overload
    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, msg_type: type[T], bind: bool, *, hwm: int = 0
    ) -> None: ...
    @overload
    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Any, bind: bool, *, hwm: int = 0) -> None: ...

    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Any, bind: bool, *, hwm: int = 0) -> None:
        super().__init__(ctx.socket(self._kind), address, msg_type, bind, hwm)


class _AsyncSender(_AsyncChannel[T]):
    async def send(self, msg: T) -> None:
        parts = self._split(msg)
        if parts is not None:
            await self._sock.send_multipart(parts, copy=False)
            return
        await self.send_bytes(self._encoder.encode(msg))

    async def send_bytes(self, data: bytes) -> None:
        """Send a message the caller already encoded as a T (with `encode`, e.g. to learn before
        sending anything else that it can be encoded at all)."""
        await self._sock.send(data, copy=len(data) < ZERO_COPY_BYTES)


class _AsyncReceiver(_AsyncChannel[T]):
    @overload
    async def recv(self) -> T: ...
    @overload
    async def recv(self, timeout_ms: int) -> T | None: ...

    async def recv(self, timeout_ms: int | None = None) -> T | None:
        """Next message; with `timeout_ms`, None if nothing arrived in time."""
        # poll() watches POLLIN by default (the typing stubs omit the flags argument).
        if timeout_ms is not None and not await self._sock.poll(timeout_ms):
            return None
        # Zero-copy: decoded straight from ZeroMQ's buffer (msgspec copies what it keeps, and a Raw field holds
        # the buffer alive). A chat body of many images is megabytes: copy=True cost it a second copy.
        frame = await self._sock.recv(copy=False)
        msg = self._decoder.decode(frame.buffer)
        if frame.more:  # a payload frame (see send): the rest of a multipart message is already here
            msg = self._attach(msg, await self._sock.recv(copy=False))
        return msg


class AsyncPushSocket(_AsyncSender[T]):
    _kind = zmq.PUSH


class AsyncPullSocket(_AsyncReceiver[T]):
    _kind = zmq.PULL


class AsyncPubSocket(_AsyncSender[T]):
    _kind = zmq.PUB


class AsyncSubSocket(_AsyncReceiver[T]):
    _kind = zmq.SUB
