"""SGLang's ``image_data`` field: images beside a raw prompt, taken by /generate (sglang_generate.py) and by
/v1/completions (what ``sglang.bench_serving --backend sglang-oai`` sends with an image dataset).

A body with images is served as a chat request whose prompt is the client's own text (``RawPromptChat``): the
images are its message's image parts, so downloads, hashing, the caches and shared memory are the chat path's,
and only the chat template is skipped. The text holds one image placeholder per image, in order, as the model's
chat template writes them (Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``). A refusal of that chat request
is reported in the body's own names: image part k is ``image_data[k]``, the text the body's text field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from workers.common.errors import BadRequest
from workers.engine.prompt.chat_template import Rendered
from workers.engine.prompt.media_items import ImageMeta, Prompt
from workers.engine.prompt.processor import MMProcessor
from workers.engine.prompt.video_prompt import VideoMeta
from workers.tokenizer.requests.chat import ChatCompletionRequest, parse_with
from workers.tokenizer.requests.chat_prompt import chat_prompt, template_options
from workers.tokenizer.requests.completion import CompletionRequest
from workers.tokenizer.requests.sampling import SamplingFields, range_error, unsupported

_IMAGE_CODES = frozenset({"too_many_images", "images_too_large"})


class RawPromptChat(ChatCompletionRequest, frozen=True, kw_only=True):
    """A body with images, as a chat request of one user message (the text, then one image part per image) whose
    prompt is ``raw_prompt`` as sent, not the chat template's rendering of that message."""

    raw_prompt: str
    # /v1/completions' own fields, kept for its answer (the chat request refuses its echo, add_special_tokens):
    echo_prompt: bool = False  # echo: the prompt's text leads the answer's
    add_specials: bool = False  # add_special_tokens: the tokens the tokenizer adds of its own accord (Gemma's <bos>)


_raw_decoder = msgspec.json.Decoder(RawPromptChat)


def raw_prompt_chat(fields: dict[str, Any], text: str, urls: list[str]) -> RawPromptChat:
    """The chat request of a body with images: ``fields`` its chat request fields (sampling and the like), ``text``
    the prompt, ``urls`` the images (``image_urls``). Raises BadRequest as the chat endpoint would."""
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": url}} for url in urls)]
    return parse_with(_raw_decoder, msgspec.json.encode({**fields, "messages": [{"role": "user", "content": parts}],
                                                         "raw_prompt": text}))


def image_urls(data: Any) -> list[str]:
    """``image_data`` as image URLs: SGLang takes one or a list, each a URL (data:, http(s):, file:), a local path
    or bare base64 (taken as a data URL: the decoder reads the format from the bytes)."""
    if data is None or data == "":
        return []
    items = [data] if isinstance(data, str) else data
    if not isinstance(items, list) or not all(isinstance(i, str) and i for i in items):
        raise range_error("image_data", "a value of that shape", "that is an image (a URL, path or base64) or a list")
    urls = []
    for item in items:
        if item[:8].lower().startswith(("data:", "http://", "https://", "file://")):  # schemes are case-insensitive
            urls.append(item)
        elif item.startswith("/") and not _is_bare_base64(item):
            urls.append("file://" + item)  # served only under --allowed-local-media-path, as any file: URL
        else:
            urls.append("data:image/png;base64," + item)
    return urls


# Every JPEG's base64 starts with "/9j/" (FF D8 FF), so a leading "/" alone does not make a path: a string of base64
# characters only (line breaks allowed, as `base64` wraps) in whole quads is the image itself; a path has a "." or
# "-" or "_", or a length base64 cannot have. A character class, not a pattern per quad: this runs over megabytes.
_BASE64_CHARS = re.compile(r"[A-Za-z0-9+/=\s]+")


def _is_bare_base64(item: str) -> bool:
    return _BASE64_CHARS.fullmatch(item) is not None and (len(item) - sum(map(item.count, " \t\r\n"))) % 4 == 0


def raw_prompt(
    processor: MMProcessor, chat: RawPromptChat, media: Sequence[ImageMeta | VideoMeta]
) -> tuple[Rendered, Prompt]:
    """A RawPromptChat's prompt: its text tokenized as the model's own (control tokens included), each image
    placeholder expanded into its image's span; with ``add_specials``, between the special tokens the tokenizer
    adds of its own accord (as text of their own, so the image spans and positions are laid out around them)."""
    before, after = processor.template.added_specials if chat.add_specials else ([], [])
    tokens = processor.tokenizer.convert_ids_to_tokens
    pieces = [(t, False) for t in tokens(before)] + [(chat.raw_prompt, False)] + [(t, False) for t in tokens(after)]
    rendered = Rendered(pieces)
    try:
        return rendered, processor.build(rendered, media)
    except ValueError as exc:
        raise BadRequest(f"The text cannot take these images: {exc}. Write one image placeholder per image, in order, "
                         "as the model's chat template does.", param="image_data") from None


def served_prompt(
    processor: MMProcessor, chat: ChatCompletionRequest, media: Sequence[ImageMeta | VideoMeta]
) -> tuple[Rendered, Prompt]:
    """A chat request's prompt as served: the client's own text for a RawPromptChat (/generate or /v1/completions
    with images), else the chat template's rendering (whose options may refuse a field)."""
    if isinstance(chat, RawPromptChat):
        return raw_prompt(processor, chat, media)
    return chat_prompt(processor, chat, media, template_options(chat, processor.template.reads))


def image_param(param: str, code: str | None, text: str) -> str:
    """A chat request's ``messages...`` param in the body's names: part 0 is the text (named ``text``), image part
    k + 1 is ``image_data[k]``; a refusal of the images as a whole (their count, their size) is ``image_data``."""
    part = re.match(r"messages\[0\]\.content\[(\d+)\]", param)
    if part is not None:
        index = int(part.group(1))
        return f"image_data[{index - 1}]" if index else text
    return "image_data" if code in _IMAGE_CODES else text


def renamed(exc: BadRequest, name: str) -> BadRequest:
    """``exc`` with its param called ``name``, in the message too where it quotes the param."""
    assert exc.param is not None
    message = exc.message.replace(f"'{exc.param}'", f"'{name}'")
    return BadRequest(message, status=exc.status, param=name, code=exc.code, type=exc.type)


# ---- /v1/completions ----------------------------------------------------------------------------------------------

_SAMPLING = frozenset(SamplingFields.__struct_fields__)


def completion_images(req: CompletionRequest) -> CompletionRequest | RawPromptChat:
    """A completions request as served: as it is without ``image_data``, else as the RawPromptChat of its one text
    prompt and images (its sampling fields and mm_processor_kwargs carried over). A batch or token ids with images,
    and what needs the prompt's log probabilities, are refused: the chat path computes none over images."""
    urls = image_urls(req.image_data)
    if not urls:
        return req
    prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
    if not isinstance(prompt, str):
        what = ("a batch of prompts (send one request per prompt)" if isinstance(prompt, list) and prompt
                and not isinstance(prompt[0], int) else "token ids")  # fmt: skip
        raise BadRequest(f"'image_data' needs one text prompt holding its image placeholders, not {what}.",
                         param="image_data", code="invalid_value")
    if req.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "a prompt with image_data has no prompt log probabilities")
    if req.echo and req.logprobs is not None:
        raise unsupported("echo", "with image_data, echo is served without logprobs (a prompt with images has no "
                          "prompt log probabilities)")
    if req.max_tokens == 0:
        raise range_error("max_tokens", 0, ">= 1 (with image_data a prompt alone is not served)")
    fields: dict[str, Any] = {name: getattr(req, name) for name in _SAMPLING}
    fields.update(mm_processor_kwargs=req.mm_processor_kwargs, echo_prompt=req.echo, add_specials=req.add_special_tokens)
    if req.logprobs is not None:
        fields.update(logprobs=True, top_logprobs=req.logprobs)
    return raw_prompt_chat(fields, prompt, urls)


def completion_names(exc: BadRequest) -> BadRequest:
    """A refusal of a completions request in its own names: those of its chat request (with images) renamed."""
    param = exc.param
    if param is None:
        return exc
    if param.startswith("messages"):
        return renamed(exc, image_param(param, exc.code, "prompt"))
    return renamed(exc, "logprobs") if param == "top_logprobs" else exc
