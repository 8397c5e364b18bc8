"""vLLM's render routes (/v1/chat/completions/render, /v1/completions/render) on the tokenizer side: the prompt a
request would be served with, as the token ids and media identifiers an external router tokenizes with (llm-d's EPP
reads ``token_ids`` and ``features``), without serving it.

A render is parsed and checked exactly as its generation would be (the same 4xx), its media fetched and identified
the same way (the identifiers are the ``MMItem.external_id`` the KV-cache events name them by), and its grids read
from headers. Unlike a generation nothing is written: no pixels, no shared memory segment, nothing for a scheduler.
The response has vLLM 0.24's shape (vllm/entrypoints/serve/disagg/protocol.py, ``GenerateRequest``): a chat render
is one object, a completions render a list of them, one per prompt. Media spans hold the model's real
``image_token_id`` / ``video_token_id``, as transformers' processor writes them, not glimpse's internal pad values.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ipc.kv_events import media_spans
from ipc.prompts import MMItem
from ipc.requests import RENDER_ENDPOINTS, GenerateRequest
from workers.engine.prompt.media_items import ImageInfo
from workers.engine.prompt.video_prompt import VideoMeta
from workers.tokenizer.media.image_io import Encoded
from workers.tokenizer.media.image_prep import ImagePrep
from workers.tokenizer.media.image_segments import NO_GRID, Listing, RequestImage
from workers.tokenizer.media.video_prep import media_items
from workers.tokenizer.requests.chat import (
    ChatCompletionRequest,
    ImageRef,
    to_sampling_params,
)
from workers.tokenizer.requests.completion import CompletionRequest, prepare_completion
from workers.tokenizer.requests.image_data import served_prompt
from workers.tokenizer.requests.sampling import hold_to_budget
from workers.tokenizer.worker import Admitted, TokenizerWorker

OnPrep = Callable[..., Awaitable[Any]]  # TokenizerService.on_prep: a CPU step on the prep thread


# ---- vLLM's response shape ----------------------------------------------------------------------


class PlaceholderRange(msgspec.Struct, frozen=True):
    offset: int  # first token of the item's span in token_ids
    length: int  # tokens in the span


class Features(msgspec.Struct, frozen=True):
    """Per modality ("image", "video"), the items in prompt order: identifiers and spans, entry for entry."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRange]]
    kwargs_data: None = None  # vLLM's serialized tensors: a render here carries none (metadata only)


class Rendered(msgspec.Struct, frozen=True):
    """One rendered prompt: what vLLM's render returns (its GenerateRequest), with the fields glimpse has."""

    request_id: str
    token_ids: list[int]
    features: Features | None
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    priority: int = 0


_encoder = msgspec.json.Encoder()


def features(items: list[MMItem]) -> Features | None:
    """The media's identifiers and placeholder ranges by modality (None for a text-only prompt, as vLLM gives): the
    items the KV-cache events name (``media_spans``: a video is one item however many frame groups it has)."""
    if not items:
        return None
    hashes: dict[str, list[str]] = {}
    spans: dict[str, list[PlaceholderRange]] = {}
    for span in media_spans(items):
        hashes.setdefault(span.modality, []).append(span.identifier)
        spans.setdefault(span.modality, []).append(PlaceholderRange(span.offset, span.end - span.offset))
    return Features(hashes, spans)


def _sampling_json(sampling: Any) -> dict[str, Any]:
    # The settings the generation would run with, in OpenAI's/vLLM's names; a grammar is not one vLLM's field takes.
    out: dict[str, Any] = msgspec.to_builtins(sampling)
    out.pop("structured", None)
    return out


# ---- the request ---------------------------------------------------------------------------------


def as_generation(req: GenerateRequest) -> GenerateRequest:
    """The render's request as the generation it renders: parsed and admitted by the same code."""
    return msgspec.structs.replace(req, endpoint=RENDER_ENDPOINTS[req.endpoint])


async def render(worker: TokenizerWorker, on_prep: OnPrep, req: GenerateRequest) -> bytes:
    """The JSON answer to a render (raises BadRequest as its generation would): admit, fetch, then lay the prompt
    out on the prep thread."""
    gen = as_generation(req)
    admitted: Admitted = await on_prep(functools.partial(worker.admit, render=True), gen)
    if admitted.remote:
        await worker.fetch(admitted)
    body: bytes = await on_prep(render_admitted, worker, gen, admitted)
    return body


def render_admitted(worker: TokenizerWorker, req: GenerateRequest, admitted: Admitted) -> bytes:
    chat = admitted.chat
    if isinstance(chat, CompletionRequest):
        return _render_completion(worker, req, chat)
    return _render_chat(worker, req, chat, admitted)


def _render_completion(worker: TokenizerWorker, req: GenerateRequest, completion: CompletionRequest) -> bytes:
    # The generation's own preparation: its checks, its token ids (a completions prompt has no media).
    _, tokenized = prepare_completion(worker, req, completion)
    sampling = _sampling_json(tokenized.sampling)
    prompts = [tokenized.input_ids, *tokenized.more_prompts]
    out = [
        Rendered(req.rid if len(prompts) == 1 else f"{req.rid}-{i}", ids, None, sampling, completion.model)
        for i, ids in enumerate(prompts)
    ]
    return _encoder.encode(out)


def plan_images(
    prep: ImagePrep, raws: list[Encoded], refs: list[ImageRef], size: dict[str, int] | None
) -> list[RequestImage]:
    """Each image part's identity and grid, repeats sharing theirs, as ImagePrep.plan finds them (``size``: the
    request's pixel range), with nothing written: the grid from a live segment of the image, else from its header
    (or its pixels processed in memory). A part named by its uuid alone renders while its segment lives, else it is
    the generation's 400 naming the uuid."""
    by_hash: dict[bytes, RequestImage] = {}
    order: list[RequestImage] = []
    listing: Listing | None = None
    for raw, ref in zip(raws, refs, strict=True):
        h = prep.identify(raw, ref.low, ref.budget, size)
        image = by_hash.get(h)
        if image is None:
            image = RequestImage(h, raw, ref.param, NO_GRID, [], low=ref.low, budget=ref.budget, size=size)
            live, listing = prep.live_segments(h, listing)
            image.grid = live[0][1] if live else prep.grid_only(image)
            by_hash[h] = image
        order.append(image)
    return order


def _render_chat(
    worker: TokenizerWorker, req: GenerateRequest, chat: ChatCompletionRequest, admitted: Admitted
) -> bytes:
    processor = worker.processor
    raws = [raw for raw in admitted.raws if raw is not None]
    assert len(raws) == len(admitted.refs), "render before every image was loaded"
    order = plan_images(worker.prep, raws, admitted.refs, admitted.settings.image_size)
    videos = worker.videos.plan(admitted.videos) if admitted.videos.refs else []  # layouts only: nothing decoded
    metas = [ImageInfo(im.hash, im.grid, processor.tokens_for_grid(im.grid)) for im in order]
    media: list[ImageInfo | VideoMeta] = [*metas, *(v.meta for v in videos)]
    _, prompt = served_prompt(processor, chat, media)
    # The generation's sampling checks too (context length, max_tokens, structured outputs): a render that succeeds
    # is a request that would be served.
    sampling = to_sampling_params(
        chat, len(prompt.input_ids), worker.max_model_len, worker.config.sampling_defaults, processor.info.vocab_size,
        validate=worker.structured.check, tool_tags=worker.structured.tool_tags,
    )
    sampling = hold_to_budget(sampling, chat, worker.config.max_logprob_entries)
    # The MMItems the generation would send (without pixels), named as it names them: the parts' uuids.
    items = media_items(prompt.spans, order, videos, [r.uuid for r in admitted.refs],
                        [r.uuid for r in admitted.videos.refs])
    if req.endpoint == "messages_count":  # Anthropic's count_tokens: the prompt's tokens, media included
        return _encoder.encode({"input_tokens": len(prompt.input_ids)})
    ids = worker.checkpoint_ids(prompt.input_ids, items)
    answer = Rendered(req.rid, ids, features(items), _sampling_json(sampling), chat.model)
    return _encoder.encode([answer] if req.endpoint == "completion" else answer)  # a completions render is a list
