"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Clients use them to count or align prompt tokens without loading the checkpoint's tokenizer themselves:
`vllm bench serve` aligns its random prompts through /tokenize, and lm-eval's remote tokenizer backend needs
all three. They run in the HTTP process on the checkpoint's own tokenizer, loaded on first use (in a thread,
so the event loop never waits on it), and never touch the scheduler.

Text only: a chat whose messages carry images or video is refused with a 400, because its prompt tokens
depend on the media's grids (the chat endpoints count them: `usage.prompt_tokens`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from server.config import ServerConfig
from server.protocol import encode, error_response, is_json

MAX_BODY_BYTES = 8 << 20


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class _BadRequest(Exception):
    def __init__(self, message: str, param: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def response(self) -> Response:
        return error_response(self.status, str(self), param=self.param, code=self.code)


def _param(message: str) -> str:
    """The field a msgspec validation message names: "... - at `$.tokens[3]`" or "... required field `tokens`"."""
    if "at `$." in message:
        return re.split(r"[.\[`]", message.rpartition("at `$.")[2])[0] or "body"
    missing = re.search(r"required field `([^`]+)`", message)
    return missing.group(1) if missing else "body"


class TokenizerEndpoints:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def tokenizer(self) -> Any:
        async with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.config.engine.model)
        return self._tokenizer

    async def _prepare(self, request: Request, kind: type[Any]) -> tuple[Any, Any]:
        """The decoded body and the tokenizer; _BadRequest for a bad body or another model's name."""
        body = await self._body(request, kind)
        if body.model is not None and body.model != self.config.served_model_name:
            raise _BadRequest(f"The model `{body.model}` does not exist.", "model", 404, "model_not_found")
        return body, await self.tokenizer()

    async def _body(self, request: Request, kind: type[Any]) -> Any:
        if not is_json(request.headers.get("content-type", "")):
            raise _BadRequest("The request body must be JSON: send it with 'Content-Type: application/json'.", "body")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise _BadRequest(f"Request body exceeds {MAX_BODY_BYTES} bytes.", "body")
        raw = await request.body()
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as exc:
            raise _BadRequest(f"Invalid request: {exc}", _param(str(exc))) from None
        except msgspec.DecodeError:
            raise _BadRequest("The body is not valid JSON.", "body") from None

    async def tokenize(self, request: Request) -> Response:
        try:
            body, tok = await self._prepare(request, TokenizeBody)
            ids = await asyncio.to_thread(self._ids, tok, body)
        except _BadRequest as exc:
            return exc.response()
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return Response(encode(out), media_type="application/json")

    @staticmethod
    def _ids(tok: Any, body: TokenizeBody) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise _BadRequest("Send either 'prompt' or 'messages'.", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return list(tok.encode(body.prompt, add_special_tokens=special))
        messages = body.messages or []
        for message in messages:
            content = message.get("content")
            parts = content if isinstance(content, list) else []
            if any(isinstance(p, dict) and p.get("type", "text") != "text" for p in parts):
                raise _BadRequest("/tokenize takes text-only messages (media tokens depend on the media).", "messages")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # a template error on malformed messages is the client's
            raise _BadRequest(f"The chat template failed on these messages: {exc}", "messages") from None
        special = False if body.add_special_tokens is None else body.add_special_tokens
        return list(tok.encode(text, add_special_tokens=special))

    async def detokenize(self, request: Request) -> Response:
        try:
            body, tok = await self._prepare(request, DetokenizeBody)
            if any(not 0 <= t < len(tok) for t in body.tokens):
                raise _BadRequest(f"Token ids must be in [0, {len(tok)}).", "tokens")
        except _BadRequest as exc:
            return exc.response()
        text = await asyncio.to_thread(tok.decode, body.tokens)
        return Response(encode({"prompt": text}), media_type="application/json")

    async def tokenizer_info(self, request: Request) -> Response:
        tok = await self.tokenizer()
        info = {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "model_max_length": self.config.max_model_len,
            "chat_template": tok.chat_template,
            "vocab_size": len(tok),
        }
        return Response(encode(info), media_type="application/json")
