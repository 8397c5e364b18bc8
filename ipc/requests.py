"""The frontend <-> tokenizer hop: an HTTP body on its way in, and what the tokenizer answers about it.

The frontend hands the body over unparsed (``GenerateRequest``); the tokenizer answers how to reply to the client
(``RequestAccepted``; a render: ``RequestRendered``) or that it failed (``RequestFailed``, ipc/control.py), and
with ``--dp`` > 1 hands the prepared request back for routing (``RouteRequest``) instead of straight to a scheduler.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from ipc.control import Msg


class GenerateRequest(Msg, frozen=True):
    """Frontend -> tokenizer: the HTTP body as received; the tokenizer parses it, not the event loop.

    A large body travels as a ZeroMQ frame of its own after the message (``payload_field``, ipc/channels.py), so
    neither end copies it into or out of msgpack, and the tokenizer reads it where ZeroMQ received it (a memoryview
    that keeps the frame alive). Decoded from one frame (a routed request), it is a view into that frame too."""

    payload_field: ClassVar[str] = "body"

    rid: str
    body: memoryview
    arrival: float  # time.time() when the frontend received it
    # Which body it is: "chat" (/v1/chat/completions), "completion" (/v1/completions), "generate" (SGLang's
    # /generate), "vllm_generate" (vLLM's /inference/v1/generate; both served as a completion, or with images a
    # chat), "responses" (OpenAI's /v1/responses) and "messages" (Anthropic's /v1/messages), both served as a chat, or a render of the first two
    # ("chat_render", "completion_render": vLLM's /render routes), answered by RequestRendered, never scheduled.
    endpoint: str = "chat"


# A render -> the body it renders. Anthropic's count_tokens is a render of a Messages body answered with its count.
RENDER_ENDPOINTS = {"chat_render": "chat", "completion_render": "completion", "messages_count": "messages_count"}


class RequestRendered(Msg, frozen=True):
    """Tokenizer -> frontend: a render's answer, the response body already JSON (the tokenizer encodes it, so the
    event loop only forwards bytes). Nothing went to a scheduler and no shared memory was written for it."""

    rid: str
    body: bytes


class RequestAccepted(Msg, frozen=True):
    """Tokenizer -> frontend: the body parsed; how to answer the client."""

    rid: str
    stream: bool
    include_usage: bool
    model: str
    prompt_tokens: int
    worker: int
    n: int = 1  # choices: outputs carry their index; the answer ends when all n finished
    endpoint: str = "chat"  # the shape to answer in: the GenerateRequest's endpoint
    echo: str = ""  # completions with echo: the prompt's text, put before each choice's text
    logprobs: bool = False  # the answer carries logprobs (even where a token has none to report)
    echoes: list[str] = []  # a batch of prompts: each choice's own echo (``echo`` is then unused)
    echo_logprobs: int | None = None  # echo with logprobs: the prompt's tokens lead the logprobs, k best each
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: choices[].prompt_logprobs, k best each
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk
    prompt_counts: list[int] = []  # a batch of prompts: each prompt's tokens (outputs carry the batch's total)
    # SGLang's /generate with return_logprob: meta_info's input logprobs start at this prompt position (None: no
    # input logprobs), and each entry's third item is the token's text (SGLang's return_text_in_logprobs).
    logprob_start_len: int | None = None
    logprob_text: bool = False
    # vLLM's return_token_ids: each choice's generated ids, and each prompt's ids (a batch: prompt p is choice p's;
    # n choices of one prompt share it).
    token_ids: bool = False
    prompt_token_ids: list[list[int]] = []
    response_fields: bytes = b""  # /v1/responses: the request's fields its Response object repeats (a JSON object)
    reasoning: bool = True  # vLLM's include_reasoning: false leaves the split-off reasoning out of the answer


class RouteRequest(Msg, frozen=True):
    """Tokenizer -> frontend with ``--dp`` > 1: a prepared request and what its router scores replicas by (the
    content keys the replica's caches use), sent after RequestAccepted. The frontend forwards ``request``, the
    encoded TokenizedRequest, unchanged to the chosen replica's scheduler."""

    rid: str
    prompt_tokens: int
    blocks: list[bytes]  # prefix-cache keys of the prompt's first full blocks (kv_cache.block_hashes)
    images: list[tuple[bytes, int, int]]  # (content hash, first token, tokens) of each distinct image
    request: msgspec.Raw
