"""The OpenAI-compatible HTTP app (`create_app`) over a `FrontendState` (server/frontend.py).

The event loop only moves bytes: a chat body goes to a tokenizer worker unparsed, and answers are
assembled from small `RequestOutput` messages routed to the request's `Flight` queue.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from itertools import chain

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ipc.control import RequestFailed
from ipc.outputs import RequestOutput
from ipc.requests import RequestAccepted
from server import protocol
from server.completion_answer import CompletionAnswer
from server.config import ServerConfig
from server.frontend import (
    DISCONNECTED,
    Disconnected,
    Flight,
    FlightEvent,
    FrontendState,
    NoTokenizer,
    Outcome,
)
from server.generate_answer import GenerateAnswer, TokensAnswer
from server.messages_answer import MessagesAnswer
from server.middleware import ApiKeyMiddleware, CorsMiddleware
from server.protocol import BodyTooLarge, error_response, is_json, read_body
from server.render_api import RENDER_PATHS, render_answer
from server.responder import Answer, ChatAnswer
from server.responses_answer import ResponsesAnswer
from server.stats import RequestCounters
from server.tokenize_api import TokenizerEndpoints

__all__ = ["ChatResponder", "FrontendState", "create_app"]


async def _watch_disconnect(receive: Receive, queue: asyncio.Queue[FlightEvent]) -> None:
    # The body was read already, so the next ASGI event is the disconnect (or the response's end).
    while (await receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(DISCONNECTED)


async def _next_batch(flight: Flight, early: list[FlightEvent]) -> list[FlightEvent]:
    """Everything available now (at least one event), buffered early outputs first."""
    if early:
        batch = early.copy()
        early.clear()
        return batch
    batch = [await flight.queue.get()]
    while not flight.queue.empty():
        batch.append(flight.queue.get_nowait())
    return batch


# A large answer goes out in sends of about this size, the loop free for other requests between them.
_SEND_BYTES = 1 << 18


def _version() -> str:
    """The installed distribution's version; a checkout run from its root (PYTHONPATH, no install) has none."""
    try:
        return importlib.metadata.version("glimpse")
    except importlib.metadata.PackageNotFoundError:
        return "0+checkout"


_VERSION = _version()


_ANSWERS: dict[str, type[Answer]] = {"completion": CompletionAnswer, "generate": GenerateAnswer,
                                     "vllm_generate": TokensAnswer, "responses": ResponsesAnswer,
                                     "messages": MessagesAnswer}


def answer_for(rid: str, created: int, accepted: RequestAccepted) -> Answer:
    return _ANSWERS.get(accepted.endpoint, ChatAnswer)(rid, created, accepted)


def _gather(pieces: Iterator[bytes]) -> bytes:
    """The next pieces up to about _SEND_BYTES (b"" once they are all taken)."""
    buf, size = [], 0
    for piece in pieces:
        buf.append(piece)
        size += len(piece)
        if size >= _SEND_BYTES:
            break
    return b"".join(buf)


async def _send_pieces(send: Send, first: bytes, pieces: Iterator[bytes], more: bool) -> None:
    """Send ``first`` then the rest of ``pieces`` in sends of about _SEND_BYTES, yielding to the loop between
    them: pieces are rendered as they are taken, so neither the whole body nor the loop is held (issue 40)."""
    body = first
    while True:
        rest = _gather(pieces)
        if not rest:
            await send({"type": "http.response.body", "body": body, "more_body": more})
            return
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await asyncio.sleep(0)
        body = rest


async def _send_whole(send: Send, pieces: Iterator[bytes]) -> None:
    """A non-streamed 200: with Content-Length when it fits one send, else chunked, as it is rendered."""
    first = _gather(pieces)
    if len(first) < _SEND_BYTES:
        await protocol.send_json(send, 200, first)
        return
    await send({"type": "http.response.start", "status": 200, "headers": protocol.JSON_HEADERS})
    await _send_pieces(send, first, pieces, False)


class ChatResponder:
    """The ASGI answer to one chat request. The handler returns it instead of a Response so it
    can watch `receive` for a disconnect for the whole request, before and after the headers."""

    def __init__(self, state: FrontendState, body: bytes, endpoint: str = "chat", started: float = 0.0) -> None:
        self.state = state
        self.endpoint = endpoint
        self.body = body
        self.started = started  # time.monotonic() when the handler began reading the body (for the step trace)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        try:
            flight = await state.submit(self.body, self.endpoint, self.started)
        except NoTokenizer:
            state.book.counters.failed += 1
            message = "Service unavailable: no tokenizer is running (one is restarting); retry shortly."
            body = protocol.error_payload(message, "server_error", code="service_unavailable")
            await protocol.send_json(send, 503, body)
            return
        self.body = b""  # a large body need not live as long as a long generation
        watcher = asyncio.create_task(_watch_disconnect(receive, flight.queue))
        outcome: Outcome = "aborted"  # what an exception or a cancellation means to the scheduler
        try:
            outcome = await self._answer(flight, send)
        finally:
            watcher.cancel()
            if outcome == "aborted":
                state.abort(flight.rid)
            state.finish(flight, outcome)

    async def _answer(self, flight: Flight, send: Send) -> Outcome:
        early: list[FlightEvent] = []  # outputs that overtook RequestAccepted (different pipes)
        while True:
            event = await flight.queue.get()
            if isinstance(event, RequestAccepted):
                break
            if isinstance(event, RequestOutput):
                early.append(event)
            elif isinstance(event, RequestFailed):
                await protocol.send_json(send, event.status, protocol.failed_payload(event))
                return "failed"
            else:
                return "aborted"
        stream, metrics = event.stream, self.state.metrics
        # n choices, logprobs, tool calls and the endpoint's shapes are the answer's business (server/responder.py).
        answer = answer_for(flight.rid, int(flight.arrival), event)
        # A stream's opening (the chat role chunk, an echo) goes out with its first outputs, as vLLM sends it: a
        # client that times the first chunk carrying choices (vLLM's bench client) would otherwise take it, sent
        # before the prefill, for the first token, and count the prefill as an inter-token gap.
        opening = b""  # made now, before any output is added to the answer (an echo's text must come first once)
        if stream:
            await send({"type": "http.response.start", "status": 200, "headers": protocol.SSE_HEADERS})
            opening = answer.start()
        first_text = True
        while True:
            failed: RequestFailed | None = None
            for ev in await _next_batch(flight, early):
                if isinstance(ev, Disconnected):
                    return "aborted"
                if isinstance(ev, RequestFailed):
                    failed = ev
                    break
                if isinstance(ev, RequestOutput):
                    if (ev.text or ev.tool_calls) and first_text:
                        first_text = False
                        metrics.ttft.observe(time.time() - flight.arrival)
                    answer.add(ev)
            if not stream:
                if failed is not None:
                    await protocol.send_json(send, failed.status, protocol.failed_payload(failed))
                elif answer.done:
                    await _send_whole(send, iter(answer.body()))
            else:
                # Everything that arrived since the last write goes out in one send: a loop that fell
                # behind catches up instead of paying per-token overhead.
                pieces = answer.flush()
                if opening:
                    pieces, opening = chain([opening], pieces), b""
                if failed is not None:  # the status line is gone: report in-band, then end as every stream does
                    pieces = chain(pieces, answer.failure(failed))
                first = _gather(pieces)
                if first:
                    if self.state.trace.enabled:  # the tokens are leaving (stamped before the write can wait)
                        self.state.trace.event("sent", rid=flight.rid)
                    await _send_pieces(send, first, pieces, failed is None and not answer.done)
            if failed is not None:
                return "failed"
            if answer.done:
                metrics.e2e.observe(time.time() - flight.arrival)
                return "ok"


def create_app(config: ServerConfig, state: FrontendState) -> Starlette:
    """The OpenAI-compatible app over `state`. Its lifespan starts the pump; closing is the launcher's."""

    async def take_body(request: Request, counted: bool = True) -> Response | bytes:
        """The body of a request for a tokenizer (a generation or a render), or the answer that refuses it. Renders
        are not ``counted``: the request counters are generations' (behind llm-d each one is rendered first)."""
        counters = state.book.counters if counted else RequestCounters()
        counters.total += 1
        if state.failed is not None or state.draining:
            counters.failed += 1
            reason = state.failed or "server is shutting down"
            return error_response(503, f"Service unavailable: {reason}", "server_error", code="service_unavailable")
        if not is_json(request.headers.get("content-type", "")):
            counters.failed += 1
            message = "The request body must be JSON: send it with 'Content-Type: application/json'."
            return error_response(400, message, code="invalid_content_type")
        try:
            return await read_body(request, config.max_body_bytes)
        except BodyTooLarge:
            counters.failed += 1
            message = f"Request body exceeds {config.max_body_bytes} bytes."
            return error_response(413, message, code="request_too_large")
        except ClientDisconnect:
            counters.aborted += 1
            return Response(status_code=400)  # nobody is listening; uvicorn drops it

    async def chat_completions(request: Request, endpoint: str = "chat") -> Response | ChatResponder:
        started = time.monotonic()
        body = await take_body(request)
        return body if isinstance(body, Response) else ChatResponder(state, body, endpoint, started)

    async def completions(request: Request) -> Response | ChatResponder:
        return await chat_completions(request, "completion")

    async def generate(request: Request) -> Response | ChatResponder:
        # SGLang's native endpoint (sglang.bench_serving's default backend): a completions request in SGLang's names.
        return await chat_completions(request, "generate")

    async def responses(request: Request) -> Response | ChatResponder:
        # OpenAI's Responses API: served as the chat request its input amounts to, answered as a Response.
        return await chat_completions(request, "responses")

    async def messages(request: Request) -> Response | ChatResponder:
        # Anthropic's Messages API: served as the chat request its messages amount to, answered as a Message.
        return await chat_completions(request, "messages")

    async def tokens_generate(request: Request) -> Response | ChatResponder:
        # vLLM's tokens-in, tokens-out endpoint: the GenerateRequest the render routes answer, generated from.
        return await chat_completions(request, "vllm_generate")

    def renders(endpoint: str) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            started = time.monotonic()
            body = await take_body(request, counted=False)
            return body if isinstance(body, Response) else await render_answer(state, body, endpoint, started)

        return handler

    async def model(request: Request) -> Response:
        if request.path_params["model"] != config.served_model_name:
            message = f"The model `{request.path_params['model']}` does not exist."
            return error_response(404, message, param="model", code="model_not_found")
        return Response(protocol.encode(model_card()), media_type="application/json")

    async def models(request: Request) -> Response:
        return Response(protocol.encode(protocol.ModelList(data=[model_card()])), media_type="application/json")

    def model_card() -> protocol.ModelCard:
        # root: the checkpoint as served (vLLM's field; `vllm bench serve` without --model reads it, and uses it
        # as the tokenizer path).
        return protocol.ModelCard(
            id=config.served_model_name, created=int(state.book.started), max_model_len=config.max_model_len,
            root=config.engine.model,
        )  # fmt: skip

    async def health(request: Request) -> Response:
        status = state.status
        if status == "ok":
            return Response(b'{"status":"ok"}', media_type="application/json")
        error = protocol.ErrorBody(state.failed or f"server is {status}", "server_error", code=status)
        return Response(protocol.encode({"status": status, "error": error}), 503, media_type="application/json")

    async def version(request: Request) -> Response:
        # vLLM's GET /version: clients and benchmark tools record the server's version beside their results.
        return Response(protocol.encode({"version": _VERSION, "server": "glimpse"}), media_type="application/json")

    async def admin_stats(request: Request) -> Response:
        snapshot = state.book.snapshot(state.outstanding, state.status)
        return Response(protocol.encode(snapshot), media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        where = f"({request.method} {request.url.path})"
        if exc.status_code == 404:
            return error_response(404, f"Invalid URL {where}", code="not_found")
        if exc.status_code == 405:
            return error_response(405, f"Method not allowed {where}", code="method_not_allowed", headers=exc.headers)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(500, "Internal server error.", "server_error")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start()
        yield

    tokenizers = TokenizerEndpoints(config)
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/inference/v1/generate", tokens_generate, methods=["POST"]),
        *(Route(path, renders(endpoint), methods=["POST"]) for endpoint, path in RENDER_PATHS.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/admin/stats", admin_stats, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenizers.tokenize, methods=["POST"]),
        Route("/detokenize", tokenizers.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizers.tokenizer_info, methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, api_key=config.api_key)] if config.api_key else []
    if config.allowed_origins:
        # Outermost: a browser's preflight (OPTIONS, no credentials) is answered before the key check.
        cors = Middleware(
            CorsMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["*"], max_age=600,
        )
        middleware.insert(0, cors)
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
