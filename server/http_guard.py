"""Connection limits uvicorn lacks, as a subclass of its httptools protocol (`guarded_protocol`).

uvicorn bounds none of what a hostile client controls before a request reaches the app: a new
connection may stay silent forever (its keep-alive timer only starts after a first response), headers
may drip a byte at a time (slowloris) or grow without bound (httptools buffers a 64 MB header whole),
a body may stall half-sent, a client may stop reading a stream so our writes pile up, and enough idle
connections exhaust the process's file descriptors, after which no request at all is served. Its own
cap (limit_concurrency) still accepts every connection and answers plain text. So, per connection:

- header deadline: from the connection's start (or the end of the previous response) until the
  request's headers are complete; past it the connection closes (408 if some of the headers came).
- header size: request line and headers past ``max_header_bytes`` get 431, counted as the bytes
  arrive (before httptools buffers them), the way nginx and Node cap them;
- idle timeout: no byte of a started request body, or no progress writing the response to a client
  that stopped reading, for ``idle_timeout_s`` closes the connection (a stalled body gets 408 first; the app
  sees a disconnect, so a generation is aborted rather than left to fill a buffer nobody reads);
- connection cap: past ``max_connections`` the oldest connection that has no request in progress
  (idle keep-alive, or still sending headers) is closed to make room, so idle floods cannot lock out
  real clients; only when every connection is busy does the new one get a JSON 503.

Errors the guard writes itself have OpenAI's JSON error shape, like every answer of the app.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.protocol import error_payload

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
_REFUSED_GRACE_S = 1.0  # a connection refused at the cap gets this long to send its request, for the 503


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float
    max_header_bytes: int


def guarded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits``; one per server (the
    class holds that server's queue of evictable connections)."""

    class _Guarded(GuardedProtocol):
        LIMITS = limits
        WAITING: ClassVar[OrderedDict[GuardedProtocol, None]] = OrderedDict()

    return _Guarded


class GuardedProtocol(HttpToolsProtocol):
    LIMITS: ClassVar[HttpLimits]
    # Connections with no request in progress, oldest first: the ones the cap may close for room.
    WAITING: ClassVar[OrderedDict[GuardedProtocol, None]]

    # ---- connection life ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._reset_header_count()
        if len(self.connections) > self.LIMITS.max_connections and not self._evict_oldest_waiting():
            # Every connection is busy with a request: refuse this one, in JSON, once it speaks.
            self._refused = True
            self._arm(_REFUSED_GRACE_S, self._close)
            return
        self._wait_for_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        self.WAITING.pop(self, None)
        super().connection_lost(exc)

    def _evict_oldest_waiting(self) -> bool:
        for other in self.WAITING:
            if other is not self:
                del self.WAITING[other]
                other._close()
                return True
        return False

    def _wait_for_request(self) -> None:
        """Between requests (or before the first): evictable, and the header deadline runs."""
        self.WAITING[self] = None
        self._arm(self.LIMITS.header_timeout_s, self._header_deadline)

    def _reset_header_count(self) -> None:
        self._in_headers = True  # the next bytes are a request line and headers
        self._header_bytes = 0
        self._tail = b""  # the last bytes seen, for a header end split across two reads

    # ---- bytes in ----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._reply_and_close(503, "The server has too many connections; retry shortly.", "too_many_connections")
            return
        if self._in_headers and self._header_overflow(data):
            limit = self.LIMITS.max_header_bytes
            self._reply_and_close(431, f"Request headers exceed {limit} bytes.", "request_header_fields_too_large")
            return
        super().data_received(data)
        if not self._in_headers and self.cycle is not None and self.cycle.more_body:
            self._arm(self.LIMITS.idle_timeout_s, self._body_idle)  # a body is arriving: restart its clock

    def _header_overflow(self, data: bytes) -> bool:
        """Count header bytes before the parser buffers them; True once past the limit."""
        window = self._tail + data
        ends = [i for i in (window.find(b"\r\n\r\n"), window.find(b"\n\n")) if i >= 0]
        if ends:  # the headers end in this read: what follows is body (or the next request)
            return self._header_bytes + min(ends) - len(self._tail) > self.LIMITS.max_header_bytes
        self._header_bytes += len(data)
        self._tail = window[-3:]
        return self._header_bytes > self.LIMITS.max_header_bytes

    def on_headers_complete(self) -> None:
        self.WAITING.pop(self, None)  # a request is in progress: not evictable until it is answered
        self._in_headers = False
        self._cancel_timer()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.LIMITS.idle_timeout_s, self._body_idle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_timer()  # the whole body is in: from here the app, not the client, takes time
        self._reset_header_count()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._wait_for_request()

    # ---- bytes out ---------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            loop = asyncio.get_running_loop()
            self._write_timer = loop.call_later(self.LIMITS.idle_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def send_400_response(self, msg: str) -> None:
        self._reply_and_close(400, msg, "invalid_http_request")  # uvicorn's own is plain text

    # ---- timers ------------------------------------------------------------------------------------

    def _arm(self, delay: float, callback: Any) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_timers(self) -> None:
        self._cancel_timer()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _header_deadline(self) -> None:
        self._timer = None
        if self._header_bytes or self._tail:  # a request had begun: tell the client why it ends
            self._reply_and_close(408, "The request headers took too long to arrive.", "request_timeout")
        else:
            self._close()

    def _body_idle(self) -> None:
        self._timer = None
        if self.flow.read_paused:  # the app has not read what came: our wait, not the client's
            self._arm(self.LIMITS.idle_timeout_s, self._body_idle)
            return
        self.logger.info("closing a connection whose request body stalled for %g s", self.LIMITS.idle_timeout_s)
        if self.cycle is not None and not self.cycle.response_started:
            # Nothing of an answer went out yet (the app is still waiting for the body): say why, as nginx and Node
            # do. The close reaches the app as a disconnect either way.
            limit = f"{self.LIMITS.idle_timeout_s:g}"
            self._reply_and_close(408, f"The request body stalled: no byte came for {limit} s.", "request_timeout")
            return
        self.transport.abort()

    def _write_stalled(self) -> None:
        self._write_timer = None
        self.logger.info("closing a connection that read none of its response for %g s", self.LIMITS.idle_timeout_s)
        self.transport.abort()  # close() would wait for a buffer the client is not reading

    # ---- answers of our own ------------------------------------------------------------------------

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _reply_and_close(self, status: int, message: str, code: str) -> None:
        if self.transport.is_closing():
            return
        body = error_payload(message, "server_error" if status >= 500 else "invalid_request_error", code=code)
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, _REASONS[status], len(body)) + body)
        self.transport.close()
