"""The tokenizer's request handling: HTTP body in, ready prompt with pixels in shared memory out.

All CPU work of a request happens here, never on the frontend's event loop: JSON parsing and
validation, base64, downloads, decoding, hashing, image processing, the chat template and
tokenization. Per request the worker answers the frontend with `RequestAccepted` and hands the
scheduler a `TokenizedRequest`, or answers `RequestFailed` and sends the scheduler nothing.

Several requests are in flight in one tokenizer at once: `TokenizerWorker` holds the steps of one
request (admit, download, prepare), workers/tokenizer/service.py runs them under an asyncio loop
(downloads on the loop, CPU steps on one prep thread) and cancels a request whose client left.

Images become shared-memory segments in workers/tokenizer/media/image_prep.py: reused by the hash of their bytes
when a live segment exists, else decoded, processed and written, the fresh images of one request
concurrently on a thread pool. With ``overlap_media`` the fresh images after a request's first have
their grids read from their headers, the prompt goes to the scheduler once the first is written and the
others' pixels follow (TokenizedRequest.pending, MediaReady): the first chunks run while later images
are still being decoded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field

import msgspec

from ipc.control import RequestFailed
from ipc.kv_events import vllm_tokens
from ipc.prompts import MMItem, TokenizedRequest
from ipc.requests import RENDER_ENDPOINTS, GenerateRequest, RequestAccepted
from ipc.stats import SchedulerStats, TokenizerStats
from workers.common.errors import BadRequest
from workers.common.reasoning_markers import opens_inside
from workers.common.text_bound import max_text_chars
from workers.common.tool_xml import arg_types
from workers.common.tools import parse_tools
from workers.config import ServerConfig
from workers.engine.prompt.media_items import ImageInfo
from workers.engine.prompt.processor import MMProcessor
from workers.engine.prompt.video_prompt import VideoMeta
from workers.engine.runner.grammar import Validator
from workers.tokenizer.media.fetch import MediaFetcher, MediaLimits, is_remote
from workers.tokenizer.media.image_io import Encoded
from workers.tokenizer.media.image_prep import ImagePrep, PendingWrite, core_share, overloaded
from workers.tokenizer.media.request_settings import ProcessorSettings, processor_settings
from workers.tokenizer.media.video_prep import (
    VideoInputs,
    VideoPrep,
    fetch_videos,
    fetch_videos_once,
    media_items,
)
from workers.tokenizer.requests.anthropic import messages_names, parse_messages
from workers.tokenizer.requests.chat import (
    ChatCompletionRequest,
    ImageRef,
    image_refs,
    parse_request,
    text_parts,
    to_sampling_params,
    tool_parser,
    video_refs,
)
from workers.tokenizer.requests.completion import CompletionRequest, parse_completion, prepare_completion
from workers.tokenizer.requests.image_data import (
    RawPromptChat,
    completion_images,
    completion_names,
    served_prompt,
)
from workers.tokenizer.requests.mm_kwargs import media_settings
from workers.tokenizer.requests.reasoning import continued_text, with_think_budget
from workers.tokenizer.requests.responses import parse_responses, responses_names
from workers.tokenizer.requests.sampling import hold_to_budget
from workers.tokenizer.requests.sglang_generate import GenerateLogprobs, parse_generate, sglang_names
from workers.tokenizer.requests.structured import structured_spec
from workers.tokenizer.requests.vllm_generate import parse_vllm_generate, vllm_names

# Past this many characters of text per context token a prompt is probably too long: a prefix of
# that size is tokenized to find out before tokenizing everything (typical text: ~4 chars a token).
_PROBE_CHARS_PER_TOKEN = 16


def _too_long(max_model_len: int, what: str) -> BadRequest:
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, your messages "
        f"resulted in {what}. Please reduce the length of the messages or images.",
        param="messages",
        code="context_length_exceeded",
    )


@dataclass
class Admitted:
    """A request past its cheap checks: parsed, its local images loaded, downloads still to do."""

    chat: ChatCompletionRequest | CompletionRequest
    refs: list[ImageRef]
    raws: list[Encoded | None]  # None: an http(s) image not downloaded yet
    videos: VideoInputs = field(default_factory=VideoInputs)
    settings: ProcessorSettings = field(default_factory=ProcessorSettings)  # mm_processor_kwargs
    logprobs: GenerateLogprobs | None = None  # /generate with return_logprob: its answer's log-prob shape
    response_fields: bytes = b""  # /v1/responses: the request's fields its Response repeats (a JSON object)

    @property
    def remote(self) -> list[int]:
        """Media still to download: images by index, then videos numbered after them."""
        return [i for i, raw in enumerate([*self.raws, *self.videos.raws]) if raw is None]


class TokenizerWorker:
    """The request handling of one tokenizer, independent of sockets."""

    def __init__(self, config: ServerConfig, index: int, log: logging.Logger) -> None:
        if config.max_model_len is None:
            raise ValueError("engine.max_model_len must be resolved by the launcher before children start")
        self.config, self.index, self.log = config, index, log
        self.max_model_len = config.max_model_len
        # Every core of the share takes a strip of a fresh image's resize: the first one is on the critical path.
        self.processor = MMProcessor(config.engine.model, config.engine.model_spec(), resize_threads=core_share(config))
        info = self.processor.info  # structured outputs are checked here, so a bad schema is a 400
        self.structured = Validator(self.processor.tokenizer, info.vocab_size, info.eos_token_ids)
        self.prep = ImagePrep(config, index, self.processor)
        self.videos = VideoPrep(config, index, self.processor)
        self.limits = MediaLimits.from_config(config)
        self.fetcher = MediaFetcher(self.limits)  # its downloads belong to the process's event loop
        # A prompt with more text than this cannot fit max_model_len, however it tokenizes.
        self.max_text_chars = max_text_chars(self.processor.tokenizer, self.max_model_len)
        # Back-pressure: the scheduler's last word on shm in flight, plus what we sent since.
        self.shm_bytes = 0
        self.shm_budget = config.shm_budget_bytes
        dp = max(1, config.dp_size)
        self.shm_by_replica = {r: (0, config.shm_budget_bytes // dp) for r in range(dp)}  # until each reports
        self.requests = self.images = 0
        # Overlap needs the one scheduler that gets the prompt to get its MediaReady too (not so through the
        # --dp router), and per-image embedding keys (a request-wide key would encode every image at once).
        self.overlap = config.overlap_media and config.dp_size <= 1 and config.engine.mm_cache_mode == "image"
        self.images_deferred = 0  # fresh images written after their request was handed on

    @property
    def images_reused(self) -> int:
        return self.prep.images_reused

    def close(self) -> None:
        self.prep.close()

    def warm_up(self, prep: Executor) -> None:
        """Before "ready": the image path on every thread that takes images (ImagePrep.warm_up), and on ``prep`` (the
        thread that builds prompts) the chat template's compile, the first tokenization and the grid of a 1080p
        page. On a fresh tokenizer these put 15-25 ms in front of its first request's hand-on (2-core box; the 7B's
        template)."""
        self.prep.warm_up(prep)
        prep.submit(self._warm_prompt).result()

    def _warm_prompt(self) -> None:
        grid = self.processor.image_grid(1920, 1080)
        if grid is None:  # a processor that cannot tell a grid in advance: any valid one will do
            grid = (1, 2 * self.processor.merge, 2 * self.processor.merge)
        messages = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Describe the page."}]}]
        media = [ImageInfo(bytes(16), grid, self.processor.tokens_for_grid(grid))]
        self.processor.build(self.processor.render(messages), media)

    def on_scheduler_stats(self, stats: SchedulerStats) -> None:
        # --dp: each replica reports its share of the budget; together they are the server's.
        self.shm_by_replica[stats.replica] = (stats.shm_bytes, stats.shm_budget_bytes)
        self.shm_bytes = sum(used for used, _ in self.shm_by_replica.values())
        self.shm_budget = sum(budget for _, budget in self.shm_by_replica.values())

    def stats(self, queue_depth: int) -> TokenizerStats:
        v = self.videos
        return TokenizerStats(
            self.index, queue_depth, self.requests, self.images, self.images_reused,
            v.videos, v.videos_decoded, v.frames_decoded, v.groups_reused, self.images_deferred,
        )

    # ---- one request ----------------------------------------------------------------------------

    def handle(self, req: GenerateRequest) -> tuple[RequestAccepted, TokenizedRequest] | RequestFailed:
        """Prepare one request start to end on the calling thread (tests, benchmarks; the process
        runs the same steps through TokenizerService)."""
        names: list[str] = []
        try:
            admitted = self.admit(req)
            if admitted.remote:
                asyncio.run(_fetch_once(MediaFetcher(self.limits), admitted))
                asyncio.run(fetch_videos_once(self.videos.fetcher.limits, admitted.videos))
            accepted, tokenized, _ = self._prepare(req, admitted, names)
            return accepted, tokenized
        except Exception as exc:
            self.prep.release(names)
            return self.failure(req, exc)

    def failure(self, req: GenerateRequest, exc: Exception) -> RequestFailed:
        """The answer to a request that raised `exc`. The caller unlinks the names it made, since the
        scheduler (the owner of unlinking) only learns of them through the TokenizedRequest."""
        if isinstance(exc, BadRequest):
            if req.endpoint == "generate":
                exc = sglang_names(exc, req.body)  # told in /generate's field names
            elif req.endpoint == "vllm_generate":
                exc = vllm_names(exc)
            elif req.endpoint == "responses":
                exc = responses_names(exc, req.body)
            elif req.endpoint in ("messages", "messages_count"):
                exc = messages_names(exc, req.body)
            elif RENDER_ENDPOINTS.get(req.endpoint, req.endpoint) == "completion":
                exc = completion_names(exc)  # with image_data, its chat request's refusals in its own names
            # Client mistakes are the frontend's access log's business; overload is the operator's.
            level = logging.WARNING if exc.status >= 500 else logging.DEBUG
            self.log.log(level, "request %s refused: %d %s", req.rid, exc.status, exc.message)
            return exc.to_failed(req.rid)
        self.log.error("request %s failed", req.rid, exc_info=exc)
        return RequestFailed(req.rid, 500, f"Internal error preparing the request: {exc}", "server_error")

    def admit(self, req: GenerateRequest, render: bool = False) -> Admitted:
        """Parse and check a request, everything that can refuse it before a download: the model,
        the prompt's length bound, the image count, shm pressure; data: and file: images load here. A ``render``
        (workers/tokenizer/render.py) writes no segment, so shm pressure does not refuse it, and is not counted."""
        self.requests += 0 if render else 1
        served = self.config.served_model_name
        logprobs, response_fields = None, b""
        chat: ChatCompletionRequest | CompletionRequest
        if req.endpoint == "generate":
            chat, logprobs = parse_generate(req.body, served)
        elif req.endpoint == "responses":
            chat, response_fields = parse_responses(req.body)
        elif req.endpoint in ("messages", "messages_count"):
            chat = parse_messages(req.body, count=req.endpoint == "messages_count")
        else:
            chat = (completion_images(parse_completion(req.body)) if req.endpoint == "completion"
                    else parse_vllm_generate(req.body, served) if req.endpoint == "vllm_generate"
                    else parse_request(req.body))  # fmt: skip
        if chat.model != self.config.served_model_name:
            message = f"The model `{chat.model}` does not exist."
            raise BadRequest(message, status=404, param="model", code="model_not_found")
        if isinstance(chat, CompletionRequest):  # no images, no template: prepare_completion does the rest
            return Admitted(chat, [], [], logprobs=logprobs)
        self._check_length(chat)
        kwargs = media_settings(chat.mm_processor_kwargs, self.processor.budgets, video=self.processor.video is not None,
                                pixel_cap=self.config.max_image_pixels)
        settings = processor_settings(kwargs, self.processor)
        refs = image_refs(chat, self.processor.budgets, kwargs)
        if len(refs) > (limit := self.config.max_images_per_request):
            message = f"The request has {len(refs)} images; this server accepts at most {limit}."
            raise BadRequest(message, param="messages", code="too_many_images")
        vrefs = video_refs(chat)
        settings.check_videos(bool(vrefs))
        if (refs or vrefs) and self.shm_bytes >= self.shm_budget and not render:
            raise overloaded()  # refuse before spending CPU on a request we could not hand on
        videos = self.videos.admit(vrefs)  # the count cap, data: and file: videos, uuid-only parts' records
        videos.settings, videos.blame = settings.video, settings.blame
        self.images += 0 if render else len(refs)
        raws = [self._image_raw(r) for r in refs]
        admitted = Admitted(chat, refs, raws, videos, settings, response_fields=response_fields)
        if admitted.remote:  # a bad data URL is refused before any download is waited for
            for raw in raws:
                if raw is not None and raw.hash is None:
                    raw.data()
        return admitted

    def _image_raw(self, ref: ImageRef) -> Encoded | None:
        """An image part's bytes as far as admission gets them: None for a download still to do; a uuid-only part's
        comes from the launch's record of it (a 400 naming the uuid if none)."""
        if ref.url is None:
            assert ref.uuid is not None
            return self.prep.named(ref.uuid, ref.uuid_param)
        if is_remote(ref.url):
            return None
        return self.prep.encoded(ref.url, functools.partial(self.fetcher.load_local, ref.url, ref.param))

    def _check_length(self, chat: ChatCompletionRequest) -> None:
        """Refuse text that cannot fit max_model_len before the template and tokenizer see all of it
        (a 40 MB prompt would otherwise take half a minute and gigabytes to be found too long)."""
        texts = text_parts(chat)
        chars = sum(len(t) for t in texts)
        if chars > self.max_text_chars:
            raise _too_long(self.max_model_len, f"more than {self.max_text_chars} characters of text")
        probe = _PROBE_CHARS_PER_TOKEN * self.max_model_len
        if chars <= probe:
            return
        prefix, size = [], 0
        for text in texts:
            prefix.append(text[: probe - size])
            size += len(prefix[-1])
            if size >= probe:
                break
        # The prompt holds this prefix and more: at least as many tokens, less a few where the
        # texts meet (the template puts tokens of its own between them anyway).
        n = len(self.processor.tokenizer("\n".join(prefix), add_special_tokens=False)["input_ids"])
        if n > self.max_model_len + 16:
            raise _too_long(self.max_model_len, f"more than {n} tokens")

    async def fetch(self, admitted: Admitted) -> None:
        """Download the request's http(s) images at once (on the process's event loop)."""
        await _fetch_with(self.fetcher, admitted)
        await fetch_videos(self.videos.fetcher, admitted.videos)

    def _prepare(
        self, req: GenerateRequest, admitted: Admitted, names: list[str], defer: bool = False, alone: bool = False
    ) -> tuple[RequestAccepted, TokenizedRequest, list[PendingWrite]]:
        """Images, prompt and shm segments of an admitted request whose images are all loaded; every
        shm name made is appended to `names`, also when this raises. With ``defer`` (and `overlap`), fresh
        images after the first are only named (the first too if the request is ``alone`` in this tokenizer):
        the returned writes are for the caller to start once the request is sent."""
        chat, refs = admitted.chat, admitted.refs
        if isinstance(chat, CompletionRequest):
            accepted, tokenized = prepare_completion(self, req, chat)
            if (lp := admitted.logprobs) is not None:
                accepted = msgspec.structs.replace(accepted, logprob_start_len=lp.start, logprob_text=lp.text)
            return accepted, tokenized, []
        raws = [raw for raw in admitted.raws if raw is not None]
        assert len(raws) == len(refs), "prepare() before every image was loaded"
        defer = defer and self.overlap
        order = self.prep.plan(raws, [r.param for r in refs], defer=defer, first_too=defer and alone,
                               low=[r.low for r in refs], budgets=[r.budget for r in refs],
                               size=admitted.settings.image_size, uuids=[r.uuid if r.url else None for r in refs])
        metas = [ImageInfo(im.hash, im.grid, self.processor.tokens_for_grid(im.grid)) for im in order]
        videos = self.videos.plan(admitted.videos) if admitted.videos.refs else []  # layouts: nothing decoded
        media: list[ImageInfo | VideoMeta] = [*metas, *(v.meta for v in videos)]
        rendered, prompt = served_prompt(self.processor, chat, media)
        raw = chat if isinstance(chat, RawPromptChat) else None  # answered in its endpoint's shape, not chat's
        sampling = to_sampling_params(
            chat, len(prompt.input_ids), self.max_model_len, self.config.sampling_defaults, self.processor.info.vocab_size,
            validate=self.structured.check, tool_tags=self.structured.tool_tags,
        )
        sampling = hold_to_budget(sampling, chat, self.config.max_logprob_entries)  # docs/limits.md
        # A raw prompt's answer is raw text, as a text completion's is: its reasoning is not split off (it would be
        # dropped, neither answer shape has a place for it).
        parser = "" if raw else self.config.reasoning_parser
        # (the prompt's end is the template's generation prompt: its last pieces, not the whole text; or the
        # assistant message it continues, which the prompt ends with)
        prompt_end = "".join(text for text, _ in rendered.pieces[-2:])
        inside = bool(parser) and opens_inside(parser, prompt_end, continued_text(chat, rendered.text))
        if inside and sampling.structured is not None:
            # A grammar masks from the first token, which is reasoning here: the JSON would land in the reasoning
            # and the answer would never close it. Refused rather than answered broken.
            found = structured_spec(chat)
            field = found[1] if found is not None else "tool_choice"
            raise BadRequest(f"'{field}' cannot constrain a reasoning model's answer while it thinks; pass "
                             "chat_template_kwargs {\"enable_thinking\": false} or leave it out.", param=field)
        sampling = with_think_budget(sampling, chat, parser, inside, self.processor.tokenizer)
        # Segments only now, after every check that could refuse the request.
        distinct = list({im.hash: im for im in order}.values())
        new_bytes, writes = self.prep.materialize(distinct, names, self.shm_bytes, self.shm_budget)
        self.images_deferred += len(writes)
        if videos:  # frame groups: linked if live, else decoded, processed and written now
            unique = list({v.hash: v for v in videos}.values())
            new_bytes += self.videos.materialize(unique, names, self.shm_bytes + new_bytes, self.shm_budget)
        self.shm_bytes += new_bytes
        items = media_items(prompt.spans, order, videos, [r.uuid for r in refs], [r.uuid for r in admitted.videos.refs])
        n = len(prompt.input_ids)
        echo = raw.raw_prompt if raw and raw.echo_prompt else ""
        accepted = RequestAccepted(
            req.rid, chat.stream, chat.include_usage, chat.model, n, self.index, sampling.n,
            req.endpoint if raw or req.endpoint in ("responses", "messages") else "chat", echo=echo,
            logprobs=sampling.logprobs is not None, continuous_usage=chat.continuous_usage,
            response_fields=admitted.response_fields, token_ids=bool(chat.return_token_ids),
            prompt_token_ids=[self.checkpoint_ids(prompt.input_ids, items)] if chat.return_token_ids else [],
            reasoning=chat.include_reasoning,
        )
        tools = tool_parser(chat, self.processor.template.tool_format)
        tokenized = TokenizedRequest(
            req.rid, prompt.input_ids, prompt.mrope_delta, items, sampling, names, new_bytes, tools,
            parser, inside, pending=[w.image.hash for w in writes],
            tool_arg_types=arg_types(parse_tools(chat.tools)) if tools == "qwen_xml" and chat.tools else {},
        )  # fmt: skip
        return accepted, tokenized, writes

    def checkpoint_ids(self, ids: list[int], items: list[MMItem]) -> list[int]:
        """The prompt as the checkpoint's processor writes it: media spans hold its image / video token id, not the
        content-derived pad values the prefix cache keys on."""
        info = self.processor.info
        return vllm_tokens(ids, 0, items, info.image_token_id, info.video_token_id)


async def _fetch_with(fetcher: MediaFetcher, admitted: Admitted) -> None:
    todo = [i for i, raw in enumerate(admitted.raws) if raw is None]
    raws = await fetcher.fetch_all([(admitted.refs[i].url or "", admitted.refs[i].param) for i in todo])
    for i, raw in zip(todo, raws, strict=True):
        admitted.raws[i] = Encoded(raw)


async def _fetch_once(fetcher: MediaFetcher, admitted: Admitted) -> None:
    try:
        await _fetch_with(fetcher, admitted)
    finally:
        await fetcher.aclose()
