"""vLLM's render routes on the HTTP side: /v1/chat/completions/render and /v1/completions/render; and Anthropic's
/v1/messages/count_tokens, a render of a Messages body answered with its prompt's token count.

A render needs what a generation's preparation needs (media fetched, hashed and probed for their grids, the chat
template applied): CPU work that must stay off the event loop, so the body goes to a tokenizer worker like any
generation's, marked as a render, and comes back as the JSON answer (workers/tokenizer/render.py builds it). The
tokenizer sends it to no scheduler, so with ``--dp`` > 1 it needs no routing either. Renders are left out of the
request counters (/admin/stats ``requests``, ``glimpse_requests*``): behind llm-d every generation is rendered first,
and counting both would double the request rate operators read.
"""

from __future__ import annotations

from starlette.responses import Response

from ipc.control import RequestFailed
from ipc.requests import RequestRendered
from server import protocol
from server.frontend import FrontendState, NoTokenizer, Outcome

RENDER_PATHS = {"chat_render": "/v1/chat/completions/render", "completion_render": "/v1/completions/render",
                "messages_count": "/v1/messages/count_tokens"}


async def render_answer(state: FrontendState, body: bytes, endpoint: str, started: float) -> Response:
    """The answer to one render (``endpoint``: "chat_render" or "completion_render"), body already read."""
    try:
        flight = await state.submit(body, endpoint, started)
    except NoTokenizer:
        message = "Service unavailable: no tokenizer is running (one is restarting); retry shortly."
        payload = protocol.error_payload(message, "server_error", code="service_unavailable")
        return Response(payload, 503, media_type="application/json")
    outcome: Outcome = "aborted"
    try:
        while True:
            # A render's only events are its answer or a failure (a dead tokenizer, a failing server): no outputs.
            event = await flight.queue.get()
            if isinstance(event, RequestRendered):
                outcome = "ok"
                return Response(event.body, media_type="application/json")
            if isinstance(event, RequestFailed):
                outcome = "failed"
                return Response(protocol.failed_payload(event), event.status, media_type="application/json")
    finally:
        # Nothing to abort elsewhere: no scheduler has it, and the tokenizer answers it in any case (its slot frees then).
        state.finish(flight, outcome)
