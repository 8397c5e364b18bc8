"""The fast JPEG path (workers/tokenizer/media/jpeg.py): Pillow's bits for the JPEGs it takes, Pillow's verdict for the rest."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from tests.conftest import noise_image
from workers.common.errors import BadRequest
from workers.tokenizer.media import jpeg
from workers.tokenizer.media.fetch import decode_image, decode_pixels


def encode(image: Image.Image, fmt: str = "JPEG", **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus grain: both the IDCT and the chroma upsampling matter to the bits."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) * 127 / (width + height)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """The fast path's start-up check runs again in the test (and after it, for the tests that follow)."""
    jpeg.fast_decoder.cache_clear()
    yield
    jpeg.fast_decoder.cache_clear()


def test_the_fast_path_gives_pillows_pixels() -> None:
    assert jpeg.fast_decoder() is not None, "simplejpeg is a dependency; its bits matched Pillow's when this was written"
    for size in [(1, 1), (17, 9), (640, 480), (1921, 1079)]:
        for options in ({"subsampling": 0}, {"subsampling": 1}, {"subsampling": 2}, {"progressive": True},
                        {"quality": 100, "optimize": True}):
            raw = encode(photo(*size, seed=size[0]), **options)
            got = decode_pixels(raw, max_pixels=10**7)
            assert isinstance(got, np.ndarray), (size, options)  # taken
            want = np.asarray(decode_image(raw, max_pixels=10**7))
            assert got.dtype == np.uint8 and np.array_equal(got, want), (size, options)


@pytest.mark.parametrize("case", ["png", "gray", "cmyk", "rotated", "mirrored"])
def test_other_images_go_through_pillow(case: str) -> None:
    image = photo(40, 24, seed=2)
    exif = Image.Exif()
    raw = {
        "png": lambda: encode(image, "PNG"),
        "gray": lambda: encode(image.convert("L")),
        "cmyk": lambda: encode(image.convert("CMYK")),
        "rotated": lambda: (exif.__setitem__(0x0112, 6), encode(image, exif=exif))[1],
        "mirrored": lambda: (exif.__setitem__(0x0112, 2), encode(image, exif=exif))[1],
    }[case]()
    got = decode_pixels(raw, max_pixels=10**6)
    want = decode_image(raw, max_pixels=10**6)
    assert isinstance(got, Image.Image) and got.mode == "RGB" and got.size == want.size
    assert np.array_equal(np.asarray(got), np.asarray(want))
    if case == "rotated":
        assert got.size == (24, 40)


def test_an_upright_orientation_tag_keeps_the_fast_path() -> None:
    exif = Image.Exif()
    exif[0x0112] = 1
    raw = encode(photo(40, 24, seed=3), exif=exif)
    got = decode_pixels(raw, max_pixels=10**6)
    assert isinstance(got, np.ndarray) and np.array_equal(got, np.asarray(decode_image(raw, max_pixels=10**6)))


def test_corrupt_jpegs_get_pillows_verdict() -> None:
    raw = encode(noise_image(64, 48, seed=5), quality=90)
    for cut in (len(raw) // 2, len(raw) - 2):  # truncated: Pillow refuses it, so must the fast path's caller
        with pytest.raises(BadRequest) as info:
            decode_pixels(raw[:cut], max_pixels=10**6, param="messages[0].content[1]")
        assert (info.value.code, info.value.param) == ("invalid_image", "messages[0].content[1]")
    # Zeros inside the entropy-coded data: libjpeg warns, Pillow decodes it anyway. The strict fast path declines,
    # and Pillow's pixels come back.
    damaged = bytearray(raw)
    damaged[len(raw) // 2 : len(raw) // 2 + 40] = bytes(40)
    got = decode_pixels(bytes(damaged), max_pixels=10**6)
    assert isinstance(got, Image.Image)
    assert np.array_equal(np.asarray(got), np.asarray(decode_image(bytes(damaged), max_pixels=10**6)))
    with pytest.raises(BadRequest) as info:  # a huge header is still refused before any decode
        decode_pixels(raw, max_pixels=64 * 47)
    assert info.value.code == "image_too_large"


def test_a_decoder_that_differs_from_pillow_is_not_used(monkeypatch: pytest.MonkeyPatch, fresh_check: None) -> None:
    import simplejpeg

    real = simplejpeg.decode_jpeg

    def off_by_one(data: bytes, **kw: object) -> np.ndarray:
        out: np.ndarray = real(data, **kw)
        out[0, 0, 0] ^= 1
        return out

    monkeypatch.setattr(simplejpeg, "decode_jpeg", off_by_one)
    assert jpeg.fast_decoder() is None
    raw = encode(photo(32, 16, seed=4))
    assert isinstance(decode_pixels(raw, max_pixels=10**6), Image.Image)


def test_without_simplejpeg_pillow_decodes(monkeypatch: pytest.MonkeyPatch, fresh_check: None) -> None:
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import raises ImportError
    assert jpeg.fast_decoder() is None
    raw = encode(photo(32, 16, seed=6))
    got = decode_pixels(raw, max_pixels=10**6)
    assert isinstance(got, Image.Image) and np.array_equal(np.asarray(got), np.asarray(decode_image(raw, 10**6)))
