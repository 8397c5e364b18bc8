"""Fetching and decoding request media inside a tokenizer process.

Three sources: ``data:`` URLs (base64), ``http(s)://`` downloads, and ``file://`` URLs under an
operator-approved directory. Every source is capped at ``max_bytes`` of encoded data, and every
image is checked against a pixel limit from its header before the full decode.

data: and file: URLs are CPU or disk work and load synchronously (on the tokenizer's prep thread);
downloads are coroutines on the tokenizer's event loop, with their deadline and SSRF guard in
workers/tokenizer/media/http_fetch.py.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import os
import stat
import urllib.parse
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import pybase64
from PIL import Image, ImageOps, UnidentifiedImageError

from workers.common.errors import BadRequest
from workers.tokenizer.media.http_fetch import HttpMediaClient, Resolver
from workers.tokenizer.media.jpeg import decode_rgb

if TYPE_CHECKING:
    from workers.config import ServerConfig


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int  # encoded bytes of one image, whatever the source
    timeout_s: float  # whole download (all redirect hops and the body), not per read
    # Empty: any host; "*.example.com" also admits subdomains; "host:port" (default: the scheme's port).
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None  # None: file:// refused
    # Private addresses downloads may reach anyway: "*", "ADDR", "CIDR", "ADDR:PORT" (see media_http).
    allowed_private: tuple[str, ...] = ()
    max_redirects: int = 5

    @classmethod
    def from_config(cls, config: ServerConfig) -> MediaLimits:
        return cls(
            max_bytes=config.max_image_bytes,
            timeout_s=config.media_timeout_s,
            allowed_domains=config.allowed_media_domains,
            allowed_local_path=config.allowed_local_media_path,
            allowed_private=config.allow_private_media_addresses,
        )


def _bad(message: str, param: str | None, code: str = "invalid_image_url") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _short(url: str) -> str:
    # Error messages echo the URL for the client's benefit, but never a multi-megabyte data URL.
    return url if len(url) <= 200 else url[:200] + "..."


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


class MediaFetcher:
    """Loads the encoded bytes behind image URLs, enforcing `MediaLimits`.

    `load_local` (data:, file:) is synchronous; `fetch` (http, https) is a coroutine and must be
    awaited on one event loop for the fetcher's life (its connection pool belongs to that loop)."""

    def __init__(self, limits: MediaLimits, resolver: Resolver | None = None) -> None:
        self.limits = limits
        self.http = HttpMediaClient(
            limits.max_bytes,
            limits.timeout_s,
            limits.allowed_domains,
            limits.allowed_private,
            limits.max_redirects,
            resolver,
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def fetch(self, url: str, param: str | None = None) -> bytes:
        """Download one http(s) URL under the deadline and the address guard."""
        return await self.http.fetch(url, param)

    async def fetch_all(self, urls: Iterable[tuple[str, str | None]]) -> list[bytes]:
        """`fetch` of each (url, param) at once, results in order; the first failure cancels the rest."""
        tasks = [asyncio.ensure_future(self.fetch(url, param)) for url, param in urls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    def load_local(self, url: str, param: str | None = None) -> bytes:
        """Encoded bytes of a data: or file: URL; BadRequest (400) for anything the client can fix."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._load_data_url(url, param)
        if scheme == "file":
            return self._load_file(url, param)
        raise _bad(
            f"Unsupported image URL {_short(url)!r}: expected a data:, http(s):// or file:// URL.", param
        )

    # ---- data: ----------------------------------------------------------------------------------

    def _load_data_url(self, url: str, param: str | None) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise _bad("Malformed data URL: no ',' before the payload.", param)
        if not header.lower().endswith(";base64"):
            raise _bad("Only base64 data URLs are supported (data:image/...;base64,...).", param)
        # Refuse before decoding: base64 grows data by 4/3, so the decoded size is known up front
        # (with 1/32 slack for line breaks in MIME-wrapped payloads; the exact check follows).
        if len(payload) // 4 * 3 > self.limits.max_bytes + self.limits.max_bytes // 32 + 3:
            raise _bad(f"The image exceeds the {self.limits.max_bytes}-byte limit.", param, "image_too_large")
        try:
            # pybase64's SIMD decoder validates as it decodes: 0.05 against binascii's 2.9 ms (strict_mode) for one
            # 1080p JPEG's 1.1 MB of base64, on the tokenizer's path before a request's first image can be decoded.
            data = pybase64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):  # ValueError: a str with non-ASCII characters
            # Some clients wrap base64 at 76 columns (MIME style); retry without whitespace only then,
            # so the common case pays no extra copy.
            try:
                data = pybase64.b64decode("".join(payload.split()), validate=True)
            except (binascii.Error, ValueError):
                raise _bad("The data URL's payload is not valid base64.", param, "invalid_base64") from None
        if len(data) > self.limits.max_bytes:
            raise _bad(f"The image exceeds the {self.limits.max_bytes}-byte limit.", param, "image_too_large")
        return data

    # ---- file: ----------------------------------------------------------------------------------

    def _load_file(self, url: str, param: str | None) -> bytes:
        root = self.limits.allowed_local_path
        if root is None:
            raise _bad("Local file URLs are not allowed on this server.", param, "local_media_not_allowed")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise _bad(f"file:// URLs must name a local path, got host {parts.netloc!r}.", param)
        path = urllib.parse.unquote(parts.path)
        if "\0" in path:  # the OS would refuse it deep inside realpath/open, as a 500
            raise _bad("file:// URLs must not contain NUL bytes.", param)
        if not os.path.isabs(path):
            raise _bad("file:// URLs must hold an absolute path.", param)
        # realpath resolves '..' and every symlink, so the containment test sees where the bytes are.
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise _bad(
                "The file is outside the directory this server may read media from.",
                param,
                "local_media_not_allowed",
            )
        try:
            # O_NONBLOCK: opening a FIFO must not hang the worker; O_NOFOLLOW: a symlink swapped in
            # after realpath is refused rather than followed out of the directory.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise _bad("The file URL does not name a regular file.", param)
                if st.st_size > self.limits.max_bytes:
                    raise _bad(
                        f"The image exceeds the {self.limits.max_bytes}-byte limit.", param, "image_too_large"
                    )
                with open(fd, "rb", closefd=False) as f:
                    data = f.read(self.limits.max_bytes + 1)
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise _bad("The file URL names a file that does not exist.", param) from None
        except OSError as exc:
            raise _bad(f"The file could not be read: {exc.strerror}.", param) from None
        if len(data) > self.limits.max_bytes:  # the file grew after fstat
            raise _bad(f"The image exceeds the {self.limits.max_bytes}-byte limit.", param, "image_too_large")
        return data


def load_media(url: str, limits: MediaLimits, *, param: str | None = None) -> bytes:
    """One-off load of any image URL (a long-lived process keeps a MediaFetcher instead)."""
    fetcher = MediaFetcher(limits)
    if not is_remote(url):
        return fetcher.load_local(url, param)

    async def once() -> bytes:
        try:
            return await fetcher.fetch(url, param)
        finally:
            await fetcher.aclose()

    return asyncio.run(once())


# ---- decoding -------------------------------------------------------------------------------------


# The raster formats a client may send (JPEG's plugin also opens phones' MPO files). Pillow would otherwise try
# every plugin it has, among them EPS, whose decoder runs Ghostscript on the client's bytes where it is installed,
# and formats no camera or browser writes. Those this Pillow lacks (AVIF before 11.2) are left out.
_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "DIB", "TIFF", "AVIF", "JPEG2000", "ICO", "PPM", "TGA")


@cache
def image_formats() -> tuple[str, ...]:
    Image.init()
    return tuple(f for f in _IMAGE_FORMATS if f in Image.OPEN)


def _open(data: bytes, max_pixels: int, param: str | None) -> Image.Image:
    """Parse the header (``Image.open`` decodes no pixels) and refuse an image past ``max_pixels``."""
    try:
        with warnings.catch_warnings():
            # Our own pixel limit replaces PIL's warning; PIL's hard error (2x its limit) is caught below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=image_formats())
    except Image.DecompressionBombError:
        raise _bad("The image is too large.", param, "image_too_large") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise _bad("The image data is not a valid image.", param, "invalid_image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise _bad(
            f"The image is too large: {width}x{height} = {width * height} pixels, the limit is {max_pixels}.",
            param,
            "image_too_large",
        )
    return image


# EXIF orientations that turn the image a quarter (transpose, 90 CW, transverse, 90 CCW): width and height swap.
_QUARTER_TURNS = frozenset((5, 6, 7, 8))


def probe_decodes(data: bytes) -> bool:
    """Whether `probe_image` decodes the pixels: for a PNG it cannot read as a one-pixel shell (`_png_shell`)."""
    return data.startswith(_PNG) and _png_shell(data) is None


_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by IHDR colour type


def _png_shell(data: bytes) -> bytes | None:
    """The PNG ``data`` with its pixels replaced by one: every other chunk as it is, in its place. A PNG's EXIF and
    XMP may follow the pixel data, so Pillow's getexif decodes the whole image to reach them (a 1080p PNG: 34 ms);
    the shell gives Pillow the same chunks to read at the cost of one pixel. None for an animation (Pillow stops
    at its next frame) or a chunk list this does not follow."""
    if not data.startswith(_PNG):
        return None
    out, pos, row, idat = [_PNG], len(_PNG), b"", False
    while pos + 8 <= len(data):
        length, kind = int.from_bytes(data[pos : pos + 4], "big"), data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if end > len(data) or kind in (b"acTL", b"fcTL", b"fdAT"):
            return None
        if kind == b"IHDR":  # width, height, then bit depth, colour type, compression, filter, interlace
            depth, color = data[pos + 16], data[pos + 17]
            if length != 13 or color not in _PNG_CHANNELS:
                return None
            out.append(_png_chunk(b"IHDR", (1).to_bytes(4, "big") * 2 + data[pos + 16 : pos + 21]))
            row = bytes(1 + (_PNG_CHANNELS[color] * depth + 7) // 8)  # filter byte, one pixel
        elif kind == b"IDAT":
            if not row:
                return None
            if not idat:
                out.append(_png_chunk(b"IDAT", zlib.compress(row)))
            idat = True
        else:
            out.append(data[pos:end])
            if kind == b"IEND":
                return b"".join(out) if idat else None
        pos = end
    return None


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def probe_image(data: bytes, max_pixels: int, param: str | None = None) -> tuple[int, int]:
    """(width, height) of the image as `decode_image` will return it, from the header alone (EXIF orientation
    applied), with the same refusals for data that is not an image or is too large. The pixels may still turn
    out corrupt: only `decode_image` finds that."""
    image = _open(data, max_pixels, param)
    width, height = image.size
    orientation = _orientation(image, data)
    return (height, width) if orientation in _QUARTER_TURNS else (width, height)


def _orientation(image: Image.Image, data: bytes) -> object:
    shell = _png_shell(data) if image.format == "PNG" and "exif" not in image.info else None
    if shell is not None:
        try:
            probe = Image.open(io.BytesIO(shell), formats=("PNG",))
            probe.load()
            return probe.getexif().get(0x0112)
        except Exception:  # Pillow's reading of the image itself decides
            pass
    try:
        return image.getexif().get(0x0112)
    except Exception:  # a malformed EXIF block: exif_transpose will not rotate by it either
        return None


def decode_pixels(data: bytes, max_pixels: int, param: str | None = None) -> Image.Image | np.ndarray:
    """`decode_image`, or for a plain RGB JPEG the same pixels as a packed [H, W, 3] uint8 array straight from
    libjpeg-turbo (workers/tokenizer/media/jpeg.py): what the serving path's resize reads, without Pillow's storage in between."""
    image = _open(data, max_pixels, param)
    pixels = decode_rgb(data, image)
    return pixels if pixels is not None else _decode(image, param)


def decode_image(data: bytes, max_pixels: int, param: str | None = None) -> Image.Image:
    """Decode encoded image bytes to an RGB image.

    The pixel count is read from the header (``Image.open`` parses only that) and refused before
    any pixel is decoded, so a small file claiming huge dimensions costs nothing. EXIF orientation
    is applied (phones store rotated JPEGs), the first frame of an animation is used, and
    transparency is flattened onto white, which is how the image looks to a person in a browser.
    """
    return _decode(_open(data, max_pixels, param), param)


def _decode(image: Image.Image, param: str | None) -> Image.Image:
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        return _to_rgb(image)
    except MemoryError:
        raise
    except Exception as exc:  # decoders raise many types for corrupt data; all are the client's data
        raise _bad(
            f"The image data is not a valid image ({type(exc).__name__}: {exc}).", param, "invalid_image"
        ) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    flat = Image.new("RGB", rgba.size, (255, 255, 255))
    flat.paste(rgba, mask=rgba.getchannel("A"))
    return flat


# OpenAI's ``detail: "low"``: the model sees the image at most 512 pixels on its longer side.
LOW_DETAIL_SIDE = 512


def low_detail_size(width: int, height: int) -> tuple[int, int]:
    """The size an image of ``width`` x ``height`` is scaled down to for ``detail: "low"`` (aspect kept)."""
    longer = max(width, height)
    if longer <= LOW_DETAIL_SIDE:
        return width, height
    scale = LOW_DETAIL_SIDE / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def low_detail(pixels: Image.Image | np.ndarray) -> Image.Image | np.ndarray:
    """Decoded RGB pixels (`decode_pixels`) as ``detail: "low"`` has them: Pillow's bicubic resize to
    `low_detail_size`, the same pixels a client gets by resizing before it sends. Small images pass as they are."""
    image = Image.fromarray(pixels, "RGB") if isinstance(pixels, np.ndarray) else pixels
    size = low_detail_size(*image.size)
    return pixels if size == image.size else image.resize(size, Image.Resampling.BICUBIC)
