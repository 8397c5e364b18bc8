"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Clients use them to count or align prompt tokens without loading the checkpoint's tokenizer themselves:
`vllm bench serve` aligns its random prompts through /tokenize, and lm-eval's remote tokenizer backend needs
all three. They run in the HTTP process on the checkpoint's own tokenizer, loaded on first use (in a thread,
so the event loop never waits on it), and never touch the scheduler.

Messages are rendered and tokenized exactly as a chat's are (workers/engine/prompt/chat_template.py): client text
stays text, so a client that types a control-token string gets the count the chat endpoint reports. Text only: a
chat whose messages carry images or video is refused with a 400, because its prompt tokens depend on the media's
grids (the chat endpoints count them: `usage.prompt_tokens`; /v1/chat/completions/render lists them). Text past
what ``max_model_len`` tokens could hold is refused before it is tokenized, as the chat endpoints refuse it.
"""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from server.config import ServerConfig
from server.protocol import BodyTooLarge, encode, error_response, is_json, read_body
from workers.common.errors import BadRequest
from workers.common.text_bound import max_text_chars
from workers.engine.prompt.chat_template import ChatTemplate
from workers.tokenizer.requests.chat import ChatCompletionRequest, parse_request, text_parts
from workers.tokenizer.requests.chat_prompt import template_messages, template_options, template_tools

MAX_BODY_BYTES = 8 << 20


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered as the chat endpoint renders them (vLLM's /tokenize takes them too)
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
        self._template: ChatTemplate | None = None
        self._max_chars = 0
        self._lock = asyncio.Lock()

    async def tokenizer(self) -> Any:
        async with self._lock:
            if self._tokenizer is None:
                self._tokenizer, self._template, self._max_chars = await asyncio.to_thread(self._load)
        return self._tokenizer

    def _load(self) -> tuple[Any, ChatTemplate, int]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.config.engine.model)
        limit = self.config.max_model_len  # resolved by the launcher; None only in a frontend built alone
        return tok, ChatTemplate(tok), max_text_chars(tok, limit) if limit else sys.maxsize

    async def _prepare(self, request: Request, kind: type[Any]) -> tuple[Any, Any]:
        """The decoded body and the tokenizer; _BadRequest for a bad body or another model's name."""
        body = await self._body(request, kind)
        if body.model is not None and body.model != self.config.served_model_name:
            raise _BadRequest(f"The model `{body.model}` does not exist.", "model", 404, "model_not_found")
        return body, await self.tokenizer()

    async def _body(self, request: Request, kind: type[Any]) -> Any:
        if not is_json(request.headers.get("content-type", "")):
            raise _BadRequest("The request body must be JSON: send it with 'Content-Type: application/json'.", "body")
        try:
            raw = await read_body(request, MAX_BODY_BYTES)
        except BodyTooLarge:
            raise _BadRequest(f"Request body exceeds {MAX_BODY_BYTES} bytes.", "body", 413, "request_too_large") from None
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as exc:
            raise _BadRequest(f"Invalid request: {exc}", _param(str(exc))) from None
        except (msgspec.DecodeError, RecursionError):  # msgspec's guard against deep nesting, even in unknown keys
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

    def _ids(self, tok: Any, body: TokenizeBody) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise _BadRequest("Send either 'prompt' or 'messages'.", "prompt")
        if body.prompt is not None:
            self._check_length(len(body.prompt), "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return list(tok.encode(body.prompt, add_special_tokens=special))
        assert self._template is not None  # loaded with the tokenizer
        chat = self._chat(body)
        self._check_length(sum(len(t) for t in text_parts(chat)), "messages")
        try:
            rendered = self._template.render(
                template_messages(chat), template_tools(chat), template_options(chat, self._template.reads)
            )
        except BadRequest as exc:
            raise _BadRequest(exc.message, exc.param or "messages") from None
        except Exception as exc:  # a template error on malformed messages is the client's
            raise _BadRequest(f"The chat template failed on these messages: {exc}", "messages") from None
        ids = self._template.token_ids(rendered)
        if body.add_special_tokens:  # off by default: the template writes its special tokens itself
            before, after = self._template.added_specials
            ids = [*before, *ids, *after]
        return ids

    @staticmethod
    def _chat(body: TokenizeBody) -> ChatCompletionRequest:
        """The messages as the chat endpoint parses them (the same checks, the same 400s)."""
        for message in body.messages or []:
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else []
            if any(isinstance(p, dict) and p.get("type", "text") != "text" for p in parts):
                raise _BadRequest("/tokenize takes text-only messages (media tokens depend on the media).", "messages")
        chat_body = {"model": "tokenize", "messages": body.messages, "add_generation_prompt": body.add_generation_prompt,
                     "continue_final_message": body.continue_final_message,
                     "chat_template_kwargs": body.chat_template_kwargs, "tools": body.tools}
        try:
            return parse_request(msgspec.json.encode(chat_body))
        except BadRequest as exc:
            raise _BadRequest(exc.message, exc.param or "messages") from None

    def _check_length(self, chars: int, param: str) -> None:
        if chars > self._max_chars:
            raise _BadRequest(f"This model's maximum context length is {self.config.max_model_len} tokens; the "
                              f"{param} holds more text ({chars} characters) than that many tokens can.", param, 400,
                              "context_length_exceeded")

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
