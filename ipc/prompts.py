"""The tokenizer -> scheduler hop: a ready prompt, its sampling settings and its images.

``TokenizedRequest`` carries token ids and, per image, where its span sits and where its pixels are (``MMItem``,
a ``ShmRef`` pointer, never pixels); ``SamplingParams`` rides along unchanged into every step plan that first
schedules the sequence. Images still being written are named in ``pending`` and later reported by
``MediaReady`` or ``MediaFailed``.
"""

from __future__ import annotations

import msgspec

from ipc.control import Msg
from ipc.shm import ShmRef


class StructuredSpec(msgspec.Struct, frozen=True, array_like=True):
    """What a structured output must match, as the request gave it (small: the worker compiles it, and
    caches the compiled grammar under this value)."""

    kind: str  # "json_schema" (value: the schema), "json_object", "regex", "choice" (a JSON list), "lark"
    value: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling settings (OpenAI's names where they exist). Encoded without the fields left at
    their defaults: every NewSeq of a plan carries one, and most requests set a few fields."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties subtract from the logits of tokens already generated; repetition_penalty (vLLM's,
    # after transformers) divides a positive logit / multiplies a negative one of tokens in the prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's log probability and the k best
    # Like logprobs, for every prompt token given the tokens before it (raw logits: no penalty, bias or mask).
    prompt_logprobs: int | None = None
    n: int = 1  # choices: the prompt is computed once, then forked into n sequences (see Fork)
    structured: StructuredSpec | None = None  # tokens are drawn only from what this grammar allows
    # vLLM's thinking_token_budget: at most this many tokens between the reasoning's start and end markers
    # (``think_ids``, one token each), the end forced at the budget (workers/engine/runner/think_budget.py);
    # ``think_inside``: the prompt opened the reasoning.
    think_budget: int | None = None
    think_ids: tuple[int, ...] = ()
    think_inside: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the tokens seen so far (prompt and output counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class MMItem(msgspec.Struct, frozen=True):
    """One image of a request: its identity, where it sits in input_ids and where its pixels are."""

    hash: bytes  # content hash, the image's identity everywhere (cache key, pad values, stats)
    offset: int  # first token of the image's span in input_ids
    length: int  # number of tokens in the span (t * h * w // merge**2)
    grid: tuple[int, int, int]  # (t, h, w) in patches, as the image processor reports it
    pixels: ShmRef | None = None  # None when pixels live in-process (offline Engine)
    # A video's frame group (one temporal patch of frames, its own item: encoded, cached and split across
    # chunks like an image): (its index in the video, its temporal M-RoPE offset). None: an image.
    frame: tuple[int, int] | None = None
    # The client's id for this media (a content part's "uuid", vLLM's multi_modal_uuids): what KV-cache events and
    # the render routes name the item by. None: the client gave none (its content hash names it).
    uuid: str | None = None

    @property
    def external_id(self) -> str:
        """What systems outside glimpse (llm-d's indexer, a render's caller) call this item."""
        return self.uuid if self.uuid is not None else self.hash.hex()


class TokenizedRequest(Msg, frozen=True):
    """Tokenizer -> scheduler: a ready prompt whose pixels are in shm (items[*].pixels), or on their way there:
    the images named in ``pending`` are still being decoded and written (their names are already fixed), and
    prefill stops short of them until ``MediaReady`` names them."""

    rid: str
    input_ids: list[int]
    mrope_delta: int  # no positions: every model rank derives them from the items' spans and grids
    items: list[MMItem]
    sampling: SamplingParams
    shm_names: list[str]  # segments this request holds a name of; the scheduler unlinks them at the end
    shm_bytes: int
    # How tool calls are read from the output ("" none): "hermes", <tool_call>{json}</tool_call> blocks; "qwen_xml",
    # Qwen3.5's <function=NAME><parameter=KEY>value blocks, each value typed by tool_arg_types[function][key];
    # "gemma4", Gemma 4's <|tool_call>call:NAME{...}<tool_call|> (its tags kept in the detokenized text).
    tool_parser: str = ""
    # --reasoning-parser's name ("" off) and whether the prompt left the answer inside the reasoning
    # (workers/common/reasoning.py): the scheduler splits each choice's text into reasoning and content.
    reasoning_parser: str = ""
    reasoning_inside: bool = False
    more_prompts: list[list[int]] = []  # a batch of text prompts (completions): choice p answers prompt p
    pending: list[bytes] = []  # hashes of images whose segments are not written yet
    tool_arg_types: dict[str, dict[str, str]] = {}  # function -> parameter -> JSON-schema type ("" unknown)


class MediaReady(Msg, frozen=True):
    """Tokenizer -> scheduler: these pending images of ``rid`` are written and published under their names."""

    rid: str
    hashes: list[bytes]


class MediaFailed(Msg, frozen=True):
    """Tokenizer -> scheduler: a pending image of ``rid`` failed; the tokenizer stopped writing, unlinked the names
    it never reported ready and answered the frontend. The scheduler drops the request without a word."""

    rid: str
