"""The app's middleware: the ``--api-key`` check and CORS (``--allowed-origins``), each answering a refusal in
OpenAI's error shape like every other answer of the server."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.protocol import error_response

# What --api-key protects.
_KEYED = ("/v1/", "/admin/", "/generate", "/inference/", "/tokenize", "/detokenize", "/tokenizer_info")


class ApiKeyMiddleware:
    """Bearer-token check for /v1/*, /admin/* and the tokenizer endpoints; /health and /metrics stay open for
    probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_KEYED):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # Anthropic's clients send the key as x-api-key instead of a bearer token.
            if b"x-api-key" in headers and not token:
                scheme, token = b"bearer", headers[b"x-api-key"]
            # compare_digest: the check must not leak how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                response = error_response(401, "Incorrect or missing API key.", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CorsMiddleware(CORSMiddleware):
    """Starlette's CORS, but a refused preflight (origin, method or headers not allowed) is a 400 in OpenAI's error
    shape like every other answer, not Starlette's plain-text "Disallowed CORS origin"."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        return error_response(400, bytes(response.body).decode(), code="cors_preflight_refused")
