"""The offline engine: processor, scheduling core and model runner in one process, in the spirit of
vLLM's ``LLM``. The serving stack runs the same three parts in separate processes."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from PIL import Image

from ipc.prompts import MMItem, SamplingParams
from ipc.steps import EncodeItem
from workers.common.detokenizer import TextStream
from workers.engine.config import EngineConfig
from workers.engine.core.host_kv_index import kv_host_report
from workers.engine.core.scheduler import FinishReason, SchedulerCore, Sequence as SchedSeq
from workers.engine.core.sequence import child_rid
from workers.engine.prompt.media_items import ImageMeta, ProcessedImage
from workers.engine.prompt.processor import MMProcessor
from workers.engine.prompt.video_prompt import VideoMeta, read_video, videos_in
from workers.engine.runner.model_runner import Launched, ModelRunner

Message = dict[str, Any]


@dataclass
class RequestOutput:
    rid: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache (either tier), as usage reports

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def images_in(messages: Sequence[Message]) -> list[Image.Image]:
    """PIL images of ``{"type": "image", "image": PIL.Image}`` parts, in prompt order."""
    found: list[Image.Image] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "image":
                image = part.get("image")
                if not isinstance(image, Image.Image):
                    raise TypeError("offline image parts need a PIL image under 'image'")
                found.append(image)
    return found


class Engine:
    """Generate from chat messages with images, in-process.

    >>> engine = Engine(EngineConfig(model="/path/to/checkpoint"))
    >>> [out] = engine.generate([[{"role": "user", "content": "hi"}]], SamplingParams(temperature=0))
    """

    def __init__(self, config: EngineConfig, async_scheduling: bool = False) -> None:
        """``async_scheduling``: queue each step before the one before it is back (as the server does; see
        ``SchedulerCore.schedule``). Off, each step is planned from the last one's result (the reference)."""
        if config.spec is None:  # read config.json once here, and hand the runner the parsed copy
            config = replace(config, spec=config.model_spec())
        if (why := config.kv_host_cache_refusal(config.model_spec())) is not None:
            raise ValueError(why)  # before the model loads
        self.config = config
        self.info = config.model_spec()
        self.processor = MMProcessor(config.model, self.info)
        self._pixels: dict[bytes, torch.Tensor] = {}
        self._pixel_refs: dict[bytes, int] = {}
        self.runner = ModelRunner(config, pixel_source=self._pixel_source)
        dtype = config.torch_dtype()
        self.core = SchedulerCore(
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            chunk_size=config.chunk_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len or self.info.max_position_embeddings,
            mm_cache_bytes=int(config.mm_cache_mb * (1 << 20)),
            mm_host_cache_bytes=config.host_cache_bytes(),
            embedding_bytes_per_token=self.info.embedding_bytes_per_token(dtype),
            eos_token_ids=self.info.eos_token_ids,
            mm_cache_mode=config.mm_cache_mode,
            enable_prefix_caching=config.enable_prefix_caching,
            lone_prefill_tokens=config.lone_prefill_tokens,
            decode_step_image_tokens=config.decode_step_image_tokens,
            encode_token_cost=config.encode_token_cost,
            encode_ahead_tokens=config.encode_ahead_tokens,
            state_slots=self.runner.num_state_slots,
            window=self.runner.window,
            window_blocks=self.runner.num_window_blocks,
            state_snapshot_every=config.state_snapshot_every,
            whole_images=self.info.bidirectional_images,
            kv_host_slots=self.runner.host_kv.num_slots if self.runner.host_kv is not None else 0,
        )
        self.core.on_finished = self._release
        self._outputs: dict[str, RequestOutput] = {}
        self._streams: dict[str, TextStream] = {}
        self._ids = itertools.count()
        self.step_log: list[tuple[int, int]] = []  # (images encoded, ViT calls) per step
        self.async_scheduling = async_scheduling
        self._running: deque[Launched] = deque()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, messages: Sequence[Message], sampling: SamplingParams | None = None, rid: str | None = None) -> str:
        sampling = sampling or SamplingParams()
        rid = rid or f"req-{next(self._ids)}"
        processed = [self.processor.process_image(img) for img in images_in(messages)]
        videos = [self._read_video(source) for source in videos_in(messages)]
        # build pairs placeholders with media kind by kind, so images may come before videos here.
        media: list[ImageMeta | VideoMeta] = [*processed, *(meta for meta, _ in videos)]
        prompt = self.processor.build(self.processor.render(messages), media)
        items = [MMItem(s.hash, s.offset, s.length, s.grid, frame=s.frame) for s in prompt.spans]
        self.core.add(rid, prompt.input_ids, prompt.mrope_delta, items, sampling)
        for image in [*processed, *(group for _, groups in videos for group in groups)]:
            self._hold(image)
        for index in range(sampling.n):  # n > 1: choice i answers as child_rid(rid, i)
            seq_rid = child_rid(rid, index)
            self._outputs[seq_rid] = RequestOutput(seq_rid, len(prompt.input_ids))
            self._streams[seq_rid] = TextStream(self.processor.tokenizer, sampling.stop, len(prompt.input_ids))
        return rid

    def peek(self, rid: str) -> RequestOutput | None:
        """The output so far of an unfinished request (None once it finished)."""
        return self._outputs.get(rid)

    def abort(self, rid: str) -> None:
        self.core.abort(rid)

    def has_unfinished(self) -> bool:
        return self.core.has_work() or bool(self._running)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the requests that finished in it."""
        if not self._running and (plan := self.core.schedule()) is not None:
            self._running.append(self.runner.launch(plan))
        if self.async_scheduling and len(self._running) == 1 and (ahead := self.core.schedule(ahead=True)) is not None:
            self._running.append(self.runner.launch(ahead))  # queued behind the running step: no host gap
        if not self._running:
            return []
        result = self._running.popleft().result()
        self.step_log.append((result.images_encoded, result.vit_calls))
        done: list[RequestOutput] = []
        for update in self.core.update(result):
            out = self._outputs[update.rid]
            out.token_ids.extend([] if update.token_id is None else [update.token_id])
            out.cached_tokens = update.cached_tokens
            # The serving path's detokenizer: incremental, UTF-8 safe, stop strings cut out.
            text, reason = self._streams[update.rid].add(update.token_id, update.finish_reason)
            out.text += text
            if reason is not None:
                if update.finish_reason is None:  # a stop string matched: the core did not know
                    self.core.finish(update.rid, "stop")
                out.finish_reason = cast(FinishReason, reason)  # the core's reason, or "stop"
                done.append(out)
                del self._outputs[update.rid], self._streams[update.rid]
        return done

    def generate(
        self, requests: Sequence[Sequence[Message]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run all requests to completion (continuous batching); outputs in input order (an n > 1 request
        gives its n choices one after another)."""
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(requests)
        added = [(self.add_request(msgs, p), p.n) for msgs, p in zip(requests, params, strict=True)]
        rids = [child_rid(rid, index) for rid, n in added for index in range(n)]
        results: dict[str, RequestOutput] = {}
        while len(results) < len(rids):
            for out in self.step():
                results[out.rid] = out
            if not self.has_unfinished() and len(results) < len(rids):
                raise RuntimeError("engine went idle with unfinished requests")
        return [results[rid] for rid in rids]

    def _read_video(self, source: bytes | str | Path) -> tuple[VideoMeta, list[ProcessedImage]]:
        """A video part's layout and its frame groups' pixels (each group held like an image)."""
        if self.processor.video is None:
            raise ValueError(f"{self.info.architecture} takes no video")
        meta, pixels = read_video(self.processor.video, source)
        return meta, [ProcessedImage(g.hash, g.grid, g.num_tokens, px) for g, px in zip(meta.groups, pixels, strict=True)]

    # ---- pixels (the offline stand-in for shared memory) ----------------------------------------
    def _hold(self, image: ProcessedImage) -> None:
        self._pixels.setdefault(image.hash, image.pixel_values)
        self._pixel_refs[image.hash] = self._pixel_refs.get(image.hash, 0) + 1

    def _release(self, seq: SchedSeq) -> None:
        for item in seq.items:
            left = self._pixel_refs.get(item.hash, 0) - 1
            if left <= 0:
                self._pixel_refs.pop(item.hash, None)
                self._pixels.pop(item.hash, None)
            else:
                self._pixel_refs[item.hash] = left

    def _pixel_source(self, item: EncodeItem) -> torch.Tensor:
        return self._pixels[item.hash]

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        idx = self.core.mm_index
        c = self.runner.counters
        return {
            "requests_running": len(self.core.running),
            "requests_waiting": len(self.core.waiting),
            "kv_blocks_used": self.core.allocator.num_used,
            "kv_blocks_total": self.core.allocator.num_blocks,
            "kv_cache_dtype": self.runner.cfg.kv_dtype_name(),
            **(self.core.windows.stats() if self.core.windows is not None else {}),
            "preemptions": self.core.preemptions,
            "prefix_cache_hit_tokens": self.core.allocator.prefix_hit_tokens,
            "prompt_tokens_computed": self.core.prompt_tokens_computed,
            "mm_cache": {
                "entries": len(idx),
                "bytes": idx.used_bytes,
                "budget_bytes": idx.budget_bytes,
                "hits": idx.stats.hits,
                "misses": idx.stats.misses,
                "evictions": idx.stats.evictions,
                "refused": idx.stats.refused,
                "hit_rate": idx.stats.hit_rate,
            },
            "mm_host_cache": {  # the host tier under it (core/mm_host_tier.py); worker_*: what the runner did
                **{k.removeprefix("mm_host_cache_"): v for k, v in idx.host.report().items()},
                "refused": idx.host.stats.refused,
                "worker_spills": self.runner.host.spilled,
                "worker_reloads": self.runner.host.reloaded,
            },
            "kv_host_cache": self._kv_host_stats(),
            "images_encoded": c.images_encoded,
            "vit_calls": c.vit_calls,
            "steps": c.steps,
            **(self.core.state.stats() if self.core.state is not None else {}),  # hybrid models' state pool
        }

    def _kv_host_stats(self) -> dict[str, int]:
        """The prefix cache's host tier (core/host_kv_index.py; zeros when off); worker_*: what the runner copied."""
        pool = self.runner.host_kv
        return {
            **{k.removeprefix("kv_host_cache_"): v for k, v in kv_host_report(self.core.allocator.host).items()},
            "worker_spills": pool.spilled if pool is not None else 0,
            "worker_loads": pool.loaded if pool is not None else 0,
        }
