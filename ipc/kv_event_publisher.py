"""The one KV-event publisher of a glimpse server: every data-parallel replica's events on one ZMQ PUB socket,
one sequence, one replay buffer (docs/kv-events.md).

Why one publisher, and why a thread of the launcher: an indexer dials one event port per pool endpoint (llm-d
dials ``socketPort + rank index`` of each InferencePool target port, and a glimpse pod serves all its replicas
behind one HTTP port), so replica r on port + r was never read; and a subscriber detects gaps and asks for
replays by one sequence per stream. Each replica's scheduler encodes its batches (ipc/kv_events.py, with its
``data_parallel_rank``) and PUSHes them, without blocking, to the launcher's ``kvev`` socket (ipc/endpoints.py:
a socket file in the launch directory, which the launcher removes on exit and a later launch sweeps after a
crash); this thread numbers them, publishes ``[topic, seq, payload]`` and keeps the last ``buffer_steps`` for
replay. The launcher outlives its schedulers, so their last batches (AllBlocksCleared) still go out. No
scheduler step ever waits on a subscriber: the PUSH drops past its high-water mark, the PUB and ROUTER too.

Replay (vLLM's, with the topic frame of vllm-project/vllm#45177): a DEALER sends ``[b"", start_seq (8 bytes,
big-endian)]`` to the ROUTER; it gets ``[b"", topic, seq, payload]`` for every buffered batch from
``start_seq`` on, then ``[b"", topic, -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
from typing import Any

import zmq

from ipc.endpoints import KV_EVENTS

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HWM = 100_000  # batches queued for a slow subscriber before a socket drops (it never blocks)


def default_topic(host: str, port: int, model: str) -> str:
    """``kv@<address>:<port>@<model>``: the pod's address and HTTP port, the endpoint an InferencePool names it by
    (llm-d keys a pod's blocks by ``address:port``), and the served model name requests carry. A wildcard
    ``--host`` is replaced by $POD_IP (Kubernetes' downward API), else the address the hostname resolves to."""
    address = host
    if host in ("", "0.0.0.0", "::"):
        address = os.environ.get("POD_IP", "")
        if not address:
            try:
                address = socket.gethostbyname(socket.gethostname())
            except OSError:
                address = "127.0.0.1"
    return f"kv@{address}:{port}@{model}"


def _binds(endpoint: str) -> bool:
    """vLLM's convention: a wildcard or a local transport is bound (subscribers dial us), any other address is
    connected to (an indexer that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventSender:
    """A replica scheduler's end: hands encoded batches to the publisher, never waiting."""

    def __init__(self, ctx: zmq.Context[Any], launch_id: str) -> None:
        self.endpoint = KV_EVENTS.address(launch_id)
        self.dropped = 0
        self._sock: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.connect(self.endpoint)

    def send(self, payload: bytes) -> None:
        try:
            self._sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.Again:  # the publisher is gone or far behind: a gap a subscriber's replay cannot fill
            self.dropped += 1

    def close(self, linger_ms: int = 0) -> None:
        if not self._sock.closed:
            self._sock.close(linger=linger_ms)


class KVEventPublisher:
    """The PUB (and replay ROUTER) sockets and the thread that feeds them from the replicas' batches.
    Sockets are opened here, so a taken port fails the caller; from then on only the thread touches them."""

    def __init__(
        self, ctx: zmq.Context[Any], launch_id: str, endpoint: str, topic: str,
        replay_endpoint: str = "", buffer_steps: int = 10_000,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.seq = 0  # the next batch's number
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=max(1, buffer_steps))
        self._stop = threading.Event()
        self._socks: list[zmq.Socket[Any]] = []
        try:
            self._pull = self._open(ctx, zmq.PULL)
            self._pull.setsockopt(zmq.RCVHWM, _HWM)
            self._pull.bind(KV_EVENTS.address(launch_id))
            self._pub = self._open(ctx, zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, _HWM)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self._replay: zmq.Socket[Any] | None = None
            if replay_endpoint:
                self._replay = self._open(ctx, zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, _HWM)
                self._replay.bind(replay_endpoint)
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)

    def _open(self, ctx: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = ctx.socket(kind)
        self._socks.append(sock)
        return sock

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._pull in ready:
                    self._drain(_HWM)
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
            self._drain(_HWM)  # what the replicas sent before they exited
        except Exception:  # a broken publisher must not take the server down: events stop, serving goes on
            log.exception("KV-event publisher failed; no more KV-cache events")

    def _drain(self, most: int) -> None:
        for _ in range(most):
            try:
                payload = self._pull.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._publish(payload)

    def _publish(self, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # a connected (not bound) PUB with no peer yet: the batch waits in the replay buffer
            pass

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        try:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            self._replay.send_multipart([client, b"", self.topic, END_SEQ, b""], zmq.NOBLOCK)
        except zmq.Again:  # the client stopped reading; it will time out and ask again
            pass

    def stop(self, linger_ms: int = 200) -> None:
        """Publish what the replicas sent so far, then close (``linger_ms`` lets it reach the subscribers)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._close(linger_ms)

    def _close(self, linger_ms: int = 0) -> None:
        for sock in self._socks:
            if not sock.closed:
                sock.close(linger=linger_ms)
