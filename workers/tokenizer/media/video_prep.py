"""A tokenizer's videos: a request's encoded videos in, one shared-memory name per frame group out.

A video's identity is the hash of its encoded bytes framed with the sampling settings; each frame group's
hash derives from it (workers/engine/prompt/video_prompt.py). Segments are named like images'
(``{group hash}-{t}x{h}x{w}-{unique}``), so a resent video finds its groups' live segments by listing
/dev/shm and links them: no decode, no processing, no write. The video's layout (sampled frames, size,
timestamps) is remembered per video hash, so a resent video does not even demux; a tokenizer that has not
seen it demuxes it (packets only, no pixels) to learn its layout.

Nothing is decoded until every check that could refuse the request has passed (``materialize``), and then
only the frames of groups without a live segment, a few groups at a time, each group written to its segment
as soon as it is processed: a long video never holds more than a batch of frames in memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ipc import shm
from ipc.prompts import MMItem
from workers.common.errors import BadRequest
from workers.config import ServerConfig
from workers.engine.prompt.media_items import ImageSpan
from workers.engine.prompt.processor import MMProcessor
from workers.engine.prompt.video_decode import VideoError, iter_frames, probe
from workers.engine.prompt.video_prompt import (
    DEFAULT_SETTINGS,
    VideoMeta,
    VideoPlan,
    VideoProcessor,
    VideoSettings,
    content_digest,
)
from workers.tokenizer.media.fetch import MediaFetcher, MediaLimits, is_remote
from workers.tokenizer.media.image_io import write_and_publish
from workers.tokenizer.media.image_segments import RequestImage
from workers.tokenizer.media.uuids import MediaRecord, UuidRegistry, unknown_uuid
from workers.tokenizer.requests.chat import ImageRef

log = logging.getLogger("glimpse.video")

LOCAL_PLANS = 256  # video layouts remembered by hash (a resent video skips the demux)
_KEY_RE = re.compile(r"(?P<hash>[0-9a-f]{32})-1x(?P<h>\d+)x(?P<w>\d+)-")


def as_video_error(exc: BadRequest) -> BadRequest:
    """The media fetcher speaks of images; the same failure for a video part says video."""
    code = exc.code.replace("image", "video") if exc.code else exc.code
    return BadRequest(exc.message.replace("image", "video"), status=exc.status, type=exc.type, param=exc.param, code=code)


@dataclass
class VideoInputs:
    """A request's video parts in prompt order, their bytes once loaded (None: a download still to do)."""

    refs: list[ImageRef] = field(default_factory=list)
    raws: list[bytes | None] = field(default_factory=list)  # b"": named by uuid alone (``records``)
    records: list[MediaRecord | None] = field(default_factory=list)  # what each uuid-only part names
    settings: VideoSettings = DEFAULT_SETTINGS  # the request's (mm_processor_kwargs)
    blame: str = ""  # the mm_processor_kwargs key a sampling failure is the fault of ("": the video's)

    @property
    def remote(self) -> list[int]:
        return [i for i, raw in enumerate(self.raws) if raw is None]


async def fetch_videos(fetcher: MediaFetcher, inputs: VideoInputs) -> None:
    """Download the http(s) videos of a request at once, under the image fetcher's guard and deadline."""
    todo = inputs.remote
    if not todo:
        return
    try:
        raws = await fetcher.fetch_all([(inputs.refs[i].url or "", inputs.refs[i].param) for i in todo])
    except BadRequest as exc:
        raise as_video_error(exc) from None
    for i, raw in zip(todo, raws, strict=True):
        inputs.raws[i] = raw


@dataclass
class RequestVideo:
    """One distinct video of a request while it is prepared."""

    hash: bytes
    raw: bytes
    param: str
    plan: VideoPlan
    candidates: list[list[str]]  # per group: live segments to link from (empty: decode and write)
    refs: list[shm.ShmRef | None]  # per group: this request's segment, once linked or written
    named: ImageRef | None = None  # the part, where it named the video by uuid alone (no bytes to decode)

    @property
    def meta(self) -> VideoMeta:
        return self.plan.meta


class VideoPrep:
    """Caps, layouts, reuse and shm segments for the videos of one tokenizer's requests."""

    def __init__(self, config: ServerConfig, index: int, processor: MMProcessor) -> None:
        self.config, self.processor = config, processor
        self.video: VideoProcessor | None = processor.video
        self.launch_id = config.launch_id
        self.dtype = config.engine.torch_dtype()
        self.row = processor.info.patch_dim
        self.plans: OrderedDict[bytes, VideoPlan] = OrderedDict()
        self.nonce = f"v{index}{os.urandom(3).hex()}-"
        self.counter = 0
        self.uuids = UuidRegistry(config.launch_id, config.shm_retain_idle_s, self.nonce)
        limits = MediaLimits.from_config(config)
        self.fetcher = MediaFetcher(dataclasses.replace(limits, max_bytes=config.max_video_bytes))
        # Counters (TokenizerStats): videos seen, videos that needed decoding, frames decoded, groups linked.
        self.videos = self.videos_decoded = self.frames_decoded = self.groups_reused = 0

    # ---- admission --------------------------------------------------------------------------------

    def admit(self, refs: list[ImageRef]) -> VideoInputs:
        """Check the count and load the data: and file: videos (downloads come later)."""
        if not refs:
            return VideoInputs()
        if self.video is None:
            raise BadRequest("This model does not take video input.", param=refs[0].param, code="video_not_supported")
        if len(refs) > (limit := self.config.max_videos_per_request):
            message = f"The request has {len(refs)} videos; this server accepts at most {limit}."
            raise BadRequest(message, param="messages", code="too_many_videos")
        raws: list[bytes | None] = []
        records: list[MediaRecord | None] = []
        for ref in refs:
            records.append(None)
            if ref.url is None:  # named by its uuid alone: what the launch's record of it says
                assert ref.uuid is not None
                record = self.uuids.get(ref.uuid)
                if record is None or record.kind != "video" or record.probe is None:
                    raise unknown_uuid(ref.uuid, ref.uuid_param)
                records[-1] = record
                raws.append(b"")
                continue
            try:
                raws.append(None if is_remote(ref.url) else self.fetcher.load_local(ref.url, ref.param))
            except BadRequest as exc:
                raise as_video_error(exc) from None
        self.videos += len(refs)
        return VideoInputs(list(refs), raws, records)

    def plan(self, inputs: VideoInputs) -> list[RequestVideo]:
        """Hash and lay out every video (demuxing those whose layout is not remembered), enforce the caps,
        and find the live segments of their groups. Nothing is decoded. One entry per video part."""
        assert self.video is not None
        by_hash: dict[bytes, RequestVideo] = {}
        order: list[RequestVideo] = []
        live: dict[str, list[str]] | None = None
        frames = 0
        for ref, raw, record in zip(inputs.refs, inputs.raws, inputs.records or [None] * len(inputs.refs), strict=True):
            assert raw is not None, "plan() before every video was loaded"
            digest = record.digest if record is not None else content_digest(raw)
            h = self.video.video_hash(digest, inputs.settings)
            if (video := by_hash.get(h)) is not None:
                order.append(video)
                continue
            plan = self._plan(h, raw, ref.param, inputs, record)
            if ref.uuid is not None and record is None:  # sent with its bytes: any tokenizer may now name it
                self.uuids.put(ref.uuid, MediaRecord("video", digest, plan.probe))
            frames += len(plan.indices)
            if frames > (cap := self.config.max_video_frames):
                message = f"The request's videos sample {frames} frames; this server decodes at most {cap} per request."
                raise BadRequest(message, param=ref.param, code="too_many_video_frames")
            live = self._list_live() if live is None else live
            candidates = [live.get(g.hash.hex(), []) for g in plan.meta.groups]
            video = RequestVideo(
                h, raw, ref.param, plan, candidates, [None] * len(candidates), ref if record is not None else None
            )
            by_hash[h] = video
            order.append(video)
        return order

    def _plan(self, h: bytes, raw: bytes, param: str, inputs: VideoInputs, record: MediaRecord | None) -> VideoPlan:
        assert self.video is not None
        plan = self.plans.get(h)
        if plan is None:
            try:
                info = record.probe if record is not None and record.probe is not None else probe(raw)
            except VideoError as exc:
                raise BadRequest(f"The video cannot be read: {exc}.", param=param, code="invalid_video") from None
            if info.duration > (seconds := self.config.max_video_seconds):
                message = f"The video is {info.duration:.1f} s long; this server takes at most {seconds:g} s."
                raise BadRequest(message, param=param, code="video_too_long")
            if info.width * info.height > self.config.max_image_pixels:
                message = f"The video's {info.width}x{info.height} frames exceed the {self.config.max_image_pixels}-pixel limit."
                raise BadRequest(message, param=param, code="video_too_large")
            try:
                plan = self.video.plan(info, h, inputs.settings)
            except ValueError as exc:  # e.g. too few frames to sample, an aspect ratio the processor refuses
                raise BadRequest(
                    f"The video cannot be processed: {exc}.", param=inputs.blame or param, code="invalid_video"
                ) from None
        self.plans[h] = plan
        self.plans.move_to_end(h)
        if len(self.plans) > LOCAL_PLANS:
            self.plans.popitem(last=False)
        return plan

    def _list_live(self) -> dict[str, list[str]]:
        skip = len(shm.shm_prefix(self.launch_id))
        live: dict[str, list[str]] = {}
        for name in reversed(shm.list_segments(self.launch_id)):
            if m := _KEY_RE.match(name, skip):
                live.setdefault(m.group("hash"), []).append(name)
        return live

    # ---- segments ---------------------------------------------------------------------------------

    def materialize(self, videos: list[RequestVideo], names: list[str], shm_bytes: int, budget: int) -> int:
        """Give this request a name for every group of every distinct video: a link to a live segment, else
        freshly decoded, processed and written pixels, refused past ``budget`` bytes in flight (``shm_bytes``
        now). Every name made is appended to ``names``, also when this raises. Returns the bytes written."""
        todo: list[tuple[RequestVideo, list[int]]] = []
        for video in videos:
            missing = [g for g, sources in enumerate(video.candidates) if not self._link(video, g, sources, names)]
            if missing:
                todo.append((video, missing))
        new_bytes = sum(self._nbytes(video) * len(missing) for video, missing in todo)
        if new_bytes and shm_bytes + new_bytes > budget:
            if new_bytes > budget:
                message = f"The videos need {new_bytes} bytes of pixels, over the server's {budget}."
                raise BadRequest(message, param="messages", code="videos_too_large")
            message = "The server has too many images in flight; retry shortly."
            raise BadRequest(message, status=503, type="server_error", code="shm_budget_exceeded")
        for video, missing in todo:
            if video.named is not None:  # no bytes to decode the gone groups from
                assert video.named.uuid is not None
                raise unknown_uuid(video.named.uuid, video.named.uuid_param)
            self._decode_and_write(video, missing, names)
        return new_bytes

    def _nbytes(self, video: RequestVideo) -> int:
        _, h, w = video.meta.groups[0].grid
        return h * w * self.row * self.dtype.itemsize

    def _ref(self, name: str, video: RequestVideo) -> shm.ShmRef:
        _, h, w = video.meta.groups[0].grid
        return shm.ShmRef(name, self._nbytes(video), shm.dtype_name(self.dtype), (h * w, self.row))

    def _new_name(self, video: RequestVideo, group: int) -> str:
        self.counter += 1
        _, h, w = video.meta.groups[0].grid
        key = f"{video.meta.groups[group].hash.hex()}-1x{h}x{w}-{self.nonce}{self.counter:x}"
        return shm.segment_name(self.launch_id, key)

    def _link(self, video: RequestVideo, group: int, sources: list[str], names: list[str]) -> bool:
        new = self._new_name(video, group)
        for source in sources:
            if shm.link_segment(source, new):
                names.append(new)
                video.refs[group] = self._ref(new, video)
                self.groups_reused += 1
                return True
        return False

    def _decode_and_write(self, video: RequestVideo, groups: list[int], names: list[str]) -> None:
        """Decode the frames of ``groups`` (ascending), process them a few groups at a time, and write each
        group to its own segment as soon as its pixels exist."""
        assert self.video is not None
        plan, temporal = video.plan, self.video.temporal
        indices = [i for g in groups for i in plan.indices[g * temporal : (g + 1) * temporal]]
        self.videos_decoded += 1
        self.frames_decoded += len(indices)
        frames = iter_frames(video.raw, plan.probe, indices)
        try:
            for group, pixels in zip(groups, self.video.group_pixels(frames, plan), strict=True):
                video.refs[group] = self._write(video, group, pixels, names)
        except VideoError as exc:
            raise BadRequest(f"The video cannot be decoded: {exc}.", param=video.param, code="invalid_video") from None

    def _write(self, video: RequestVideo, group: int, pixels: torch.Tensor, names: list[str]) -> shm.ShmRef:
        if pixels.dim() != 2 or pixels.shape[1] != self.row:
            raise RuntimeError(f"pixels are {tuple(pixels.shape)}, expected rows {self.row} wide")
        final = self._new_name(video, group)
        names.append(final)  # recorded before it exists: a failure below still gets it unlinked
        self.counter += 1
        tmp = shm.segment_name(self.launch_id, f"tmp-{self.nonce}{self.counter:x}")
        return write_and_publish(self._ref(tmp, video), pixels, final)


async def fetch_videos_once(limits: MediaLimits, inputs: VideoInputs) -> None:
    """``fetch_videos`` with a fetcher of its own (a caller without a long-lived event loop)."""
    fetcher = MediaFetcher(limits)
    try:
        await fetch_videos(fetcher, inputs)
    finally:
        await fetcher.aclose()


def media_items(
    spans: list[ImageSpan], images: list[RequestImage], videos: list[RequestVideo],
    image_uuids: list[str | None] | None = None, video_uuids: list[str | None] | None = None,
) -> list[MMItem]:
    """The request's MMItems in prompt order: image spans take the images' segments in order, frame-group
    spans the groups' segments of the videos in order; each carries its part's uuid (a video's on every group)."""
    next_image, next_video = iter(images), iter(videos)
    next_image_uuid, next_video_uuid = iter(image_uuids or [None] * len(images)), iter(video_uuids or [None] * len(videos))
    video: RequestVideo | None = None
    uuid: str | None = None
    items: list[MMItem] = []
    for span in spans:
        if span.frame is None:
            ref, uuid = next(next_image).ref, next(next_image_uuid)
        else:
            if span.frame[0] == 0:
                video, uuid = next(next_video), next(next_video_uuid)
            assert video is not None
            ref = video.refs[span.frame[0]]
        items.append(MMItem(span.hash, span.offset, span.length, span.grid, ref, span.frame, uuid))
    return items
