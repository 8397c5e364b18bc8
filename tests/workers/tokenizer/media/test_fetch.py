"""Media loading and decoding: data URLs and local files (downloads: test_media_http.py)."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import noise_image
from workers.common.errors import BadRequest
from workers.tokenizer.media.fetch import MediaLimits, decode_image, load_media, probe_decodes, probe_image

LIMITS = MediaLimits(max_bytes=1 << 20, timeout_s=5.0)


def encode(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def check(
    info: pytest.ExceptionInfo[BadRequest], code: str, text: str = "", param: str | None = None
) -> None:
    err = info.value
    assert (err.status, err.code, err.param) == (400, code, param), repr(err)
    assert text.lower() in err.message.lower(), err.message


def check_load_refused(url: str, limits: MediaLimits, code: str, text: str = "", param: str | None = None) -> None:
    """``load_media`` refuses ``url`` with a 400 of ``code`` naming ``param``, its message holding ``text``."""
    with pytest.raises(BadRequest) as info:
        load_media(url, limits, param=param)
    check(info, code, text, param=param)


PNG = encode(noise_image(40, 30, seed=1), "PNG")


# ---- data URLs and decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_data_url_round_trip(fmt: str) -> None:
    raw = encode(noise_image(64, 48, seed=3), fmt)
    got = load_media(data_url(raw, f"image/{fmt.lower()}"), LIMITS)
    assert got == raw
    image = decode_image(got, max_pixels=10_000)
    assert image.mode == "RGB" and image.size == (64, 48)
    expected = Image.open(io.BytesIO(raw)).convert("RGB")
    assert np.array_equal(np.asarray(image), np.asarray(expected))
    if fmt == "PNG":  # lossless: exactly the pixels we encoded
        assert np.array_equal(np.asarray(image), np.asarray(noise_image(64, 48, seed=3)))


def test_data_url_wrapped_base64_is_accepted() -> None:
    b64 = base64.encodebytes(PNG).decode()  # MIME style: a newline every 76 characters
    assert "\n" in b64
    assert load_media(f"data:image/png;base64,{b64}", LIMITS) == PNG


@pytest.mark.parametrize(
    ("url", "code", "text"),
    [
        ("data:image/png;base64,!!!not base64!!!", "invalid_base64", "base64"),
        ("data:image/png;base64,QUJ", "invalid_base64", "base64"),  # bad padding
        ("data:image/png;base64", "invalid_image_url", "malformed"),
        ("data:image/png,rawbytes", "invalid_image_url", "base64"),
        ("ftp://example.com/a.png", "invalid_image_url", "unsupported"),
        ("/etc/passwd", "invalid_image_url", "unsupported"),
    ],
)
def test_bad_urls(url: str, code: str, text: str) -> None:
    check_load_refused(url, LIMITS, code, text, param="messages[0].content[1].image_url")


def test_data_url_over_byte_cap() -> None:
    check_load_refused(data_url(PNG), MediaLimits(max_bytes=len(PNG) - 1, timeout_s=1), "image_too_large")


def test_non_image_bytes() -> None:
    with pytest.raises(BadRequest) as info:
        decode_image(b"this is plain text, not an image", max_pixels=10**6, param="p")
    check(info, "invalid_image", "not a valid image", param="p")
    with pytest.raises(BadRequest) as info:  # a real PNG cut short: the header parses, the pixels do not
        decode_image(PNG[: len(PNG) // 2], max_pixels=10**6)
    check(info, "invalid_image", "not a valid image")


# Formats Pillow reads but a client has no business sending: EPS runs Ghostscript on the bytes where it is installed.
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"


def test_formats_outside_the_raster_list_are_refused_before_any_plugin_decodes_them() -> None:
    assert Image.open(io.BytesIO(EPS)).format == "EPS"  # Pillow alone takes it (and would call Ghostscript)
    for call in (decode_image, probe_image):
        with pytest.raises(BadRequest) as info:
            call(EPS, max_pixels=10**6, param="p")
        check(info, "invalid_image", "not a valid image", param="p")
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):  # what cameras, browsers and scanners write
        assert decode_image(encode(noise_image(9, 7), fmt), max_pixels=10**6).size == (9, 7), fmt


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (pixels absent): only a header check can be fast."""
    raw = bytearray(encode(Image.new("RGB", (1, 1)), "PNG"))
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    raw[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(raw[ihdr : ihdr + 17])))
    return bytes(raw)


@pytest.mark.parametrize("side", [8000, 100_000])  # over our limit; over PIL's own bomb limit too
def test_too_many_pixels_is_refused_from_the_header(side: int) -> None:
    start = time.perf_counter()
    with pytest.raises(BadRequest) as info:
        decode_image(png_claiming(side, side), max_pixels=40_000_000)
    check(info, "image_too_large", "too large")
    assert time.perf_counter() - start < 0.5


def test_alpha_is_flattened_on_white_and_exif_orientation_applied() -> None:
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black
    image = decode_image(encode(rgba, "PNG"), max_pixels=100)
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255) and image.getpixel((1, 0)) == (10, 20, 30)

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    upright = decode_image(encode(noise_image(40, 20), "JPEG", exif=exif), max_pixels=10_000)
    assert upright.size == (20, 40)


# ---- local files ------------------------------------------------------------------------------------


@pytest.fixture
def media_dirs(tmp_path: Path) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (outside / "b.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "b.png")
    (allowed / "sub").symlink_to(outside)
    return allowed, outside


def test_local_file_inside_allowed_dir(media_dirs: tuple[Path, Path]) -> None:
    allowed, _ = media_dirs
    limits = MediaLimits(max_bytes=1 << 20, timeout_s=1.0, allowed_local_path=str(allowed))
    assert load_media(f"file://{allowed}/a.png", limits) == PNG
    assert load_media(f"file://localhost{allowed}/a%2Epng", limits) == PNG  # percent-encoding decoded
    small = MediaLimits(max_bytes=100, timeout_s=1.0, allowed_local_path=str(allowed))
    check_load_refused(f"file://{allowed}/a.png", small, "image_too_large")
    check_load_refused(f"file://{allowed}/missing.png", limits, "invalid_image_url", "does not exist")
    check_load_refused(f"file://{allowed}", limits, "invalid_image_url", "regular file")


def test_local_file_escapes_are_refused(media_dirs: tuple[Path, Path]) -> None:
    allowed, outside = media_dirs
    limits = MediaLimits(max_bytes=1 << 20, timeout_s=1.0, allowed_local_path=str(allowed))
    escapes = [
        f"file://{outside}/b.png",  # plainly outside
        f"file://{allowed}/../outside/b.png",  # via ..
        f"file://{allowed}/link.png",  # via a symlinked file
        f"file://{allowed}/sub/b.png",  # via a symlinked directory
        f"file://{allowed}/%2E%2E/outside/b.png",  # via an encoded ..
    ]
    for url in escapes:
        check_load_refused(url, limits, "local_media_not_allowed", "outside")
    check_load_refused(f"file://otherhost{allowed}/a.png", limits, "invalid_image_url", "host")


def test_local_files_refused_without_allowed_path(media_dirs: tuple[Path, Path]) -> None:
    allowed, _ = media_dirs
    check_load_refused(f"file://{allowed}/a.png", LIMITS, "local_media_not_allowed", "not allowed")


# ---- a PNG's orientation without its pixels -----------------------------------------------------------


def png_chunks(raw: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 8
    while pos < len(raw):
        length = int.from_bytes(raw[pos : pos + 4], "big")
        out.append((raw[pos + 4 : pos + 8], raw[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return out


def png_of(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(len(d).to_bytes(4, "big") + k + d + zlib.crc32(k + d).to_bytes(4, "big") for k, d in chunks)
    return b"\x89PNG\r\n\x1a\n" + body


def after_the_pixels(raw: bytes, extra: list[tuple[bytes, bytes]]) -> bytes:
    """``raw`` with ``extra`` chunks placed between its last IDAT and IEND."""
    chunks = png_chunks(raw)
    return png_of(chunks[:-1] + extra + chunks[-1:])


def xmp_chunk(orientation: int) -> tuple[bytes, bytes]:
    packet = f'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'
    return b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + packet.encode()


@pytest.mark.parametrize("where", ["eXIf", "XMP"])
def test_a_png_orientation_after_its_pixels_is_read_without_decoding_them(where: str) -> None:
    image = noise_image(40, 20, seed=8)
    exif = Image.Exif()
    exif[0x0112] = 6
    extra = [(b"eXIf", exif.tobytes())] if where == "eXIf" else [xmp_chunk(6)]
    raw = after_the_pixels(encode(image, "PNG"), extra)
    assert decode_image(raw, max_pixels=10_000).size == (20, 40)  # Pillow turns it, once the pixels are read
    assert not probe_decodes(raw) and probe_image(raw, max_pixels=10_000) == (20, 40)
    # Pixel data that would not even inflate: the probe never reads it.
    chunks = png_chunks(raw)
    broken = png_of([(k, bytes(len(d)) if k == b"IDAT" else d) for k, d in chunks])
    with pytest.raises(BadRequest):
        decode_image(broken, max_pixels=10_000)
    assert probe_image(broken, max_pixels=10_000) == (20, 40)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "I;16", "1", "LA"])
@pytest.mark.parametrize("interlace", [False, True])
def test_the_png_probe_agrees_with_the_decode_for_every_layout(mode: str, interlace: bool) -> None:
    image = noise_image(33, 17, seed=9).convert(mode)
    for orientation in (1, 8):
        exif = Image.Exif()
        exif[0x0112] = orientation
        raw = after_the_pixels(encode(image, "PNG", interlace=interlace), [(b"eXIf", exif.tobytes())])
        assert not probe_decodes(raw)
        assert probe_image(raw, max_pixels=10_000) == decode_image(raw, max_pixels=10_000).size


def test_an_animated_png_is_probed_by_pillow_itself() -> None:
    frames = [noise_image(24, 16, seed=s) for s in (1, 2)]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    raw = buf.getvalue()
    assert any(k == b"acTL" for k, _ in png_chunks(raw))
    assert probe_decodes(raw) and probe_image(raw, max_pixels=10_000) == (24, 16)
