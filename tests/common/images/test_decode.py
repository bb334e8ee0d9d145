"""Tests for common.images.decode. Every image is built here with Pillow or by hand; no binary fixtures."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import struct
import time
import warnings
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image, ImageFile

from common.images.decode import (
    DEFAULT_ALLOWED_FORMATS,
    ImageError,
    ImageInfo,
    decode_image,
    inspect_image,
    parse_data_url,
    to_rgb,
)

MAX_PIXELS = 50_000_000
ALLOWED_TEXT = "JPEG, PNG, WEBP, GIF, BMP"
RED, GREEN, BLUE, WHITE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)


def encode(im: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def noise_image(size: tuple[int, int] = (64, 64), seed: int = 0) -> Image.Image:
    # Noise does not compress, so cutting the file in half really removes pixel data.
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def assert_close(actual: float | tuple[int, ...] | None, expected: tuple[int, ...], tolerance: int) -> None:
    assert isinstance(actual, tuple) and len(actual) == len(expected)
    assert all(abs(a - e) <= tolerance for a, e in zip(actual, expected, strict=True)), (actual, expected)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def palette_png_bomb(width: int, height: int) -> bytes:
    """A valid 1-bit palette PNG of all-zero rows: huge when decoded, tiny on disk."""
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    rows_per_step = 1000
    parts = []
    for start in range(0, height, rows_per_step):
        parts.append(compressor.compress(row * min(rows_per_step, height - start)))
    parts.append(compressor.flush())
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 3, 0, 0, 0)),
            _chunk(b"PLTE", bytes([0, 0, 0, 255, 255, 255])),
            _chunk(b"IDAT", b"".join(parts)),
            _chunk(b"IEND", b""),
        ]
    )


@pytest.fixture(scope="module")
def bomb_400mp() -> bytes:
    return palette_png_bomb(20_000, 20_000)


@pytest.fixture(scope="module")
def bomb_81mp() -> bytes:
    # Below Pillow's own default limit (~89 MP), so only this module's max_pixels check can refuse it.
    return palette_png_bomb(9_000, 9_000)


@pytest.fixture
def no_pixel_decoding(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    yield


# --- round trips ---------------------------------------------------------------------------------------

COLOUR = (200, 100, 50)
ROUND_TRIPS = [
    ("PNG", {}, 0),
    ("JPEG", {"quality": 95}, 4),
    ("WEBP", {"lossless": True}, 0),
    ("GIF", {}, 0),
    ("BMP", {}, 0),
]


@pytest.mark.parametrize(("fmt", "params", "tolerance"), ROUND_TRIPS)
def test_round_trip_inspect_and_decode(fmt: str, params: dict[str, object], tolerance: int) -> None:
    data = encode(Image.new("RGB", (32, 16), COLOUR), fmt, **params)

    info = inspect_image(data, max_pixels=MAX_PIXELS)
    assert info == ImageInfo(
        sha256=hashlib.sha256(data).hexdigest(), format=fmt, width=32, height=16, size_bytes=len(data)
    )
    assert len(info.sha256) == 64

    im = decode_image(data, max_pixels=MAX_PIXELS)
    assert im.mode == "RGB"
    assert im.size == (32, 16)
    assert_close(im.getpixel((5, 5)), COLOUR, tolerance)
    assert_close(im.getpixel((31, 15)), COLOUR, tolerance)


def test_sha256_is_of_raw_bytes() -> None:
    data = encode(Image.new("RGB", (4, 4), COLOUR), "PNG")
    other = encode(Image.new("RGB", (4, 4), (0, 0, 0)), "PNG")
    assert inspect_image(data, max_pixels=100).sha256 == hashlib.sha256(data).hexdigest()
    assert inspect_image(data, max_pixels=100).sha256 != inspect_image(other, max_pixels=100).sha256


def test_default_allowed_formats() -> None:
    assert DEFAULT_ALLOWED_FORMATS == ("JPEG", "PNG", "WEBP", "GIF", "BMP")


def test_multi_picture_jpeg_counts_as_jpeg() -> None:
    # Phone cameras write MPO; it must not be refused as an unknown format.
    frames = [Image.new("RGB", (16, 8), RED), Image.new("RGB", (16, 8), BLUE)]
    data = encode(frames[0], "MPO", save_all=True, append_images=frames[1:])
    assert inspect_image(data, max_pixels=1000).format == "JPEG"
    assert_close(decode_image(data, max_pixels=1000).getpixel((4, 4)), RED, 8)


# --- format allow-list ---------------------------------------------------------------------------------


def test_tiff_refused_with_format_name() -> None:
    data = encode(Image.new("RGB", (8, 8), COLOUR), "TIFF")
    expected = f"image format TIFF is not allowed (allowed: {ALLOWED_TEXT})"
    with pytest.raises(ImageError) as inspected:
        inspect_image(data, max_pixels=MAX_PIXELS)
    assert str(inspected.value) == expected
    with pytest.raises(ImageError) as decoded:
        decode_image(data, max_pixels=MAX_PIXELS)
    assert str(decoded.value) == expected


def test_tiff_declared_as_png_is_still_refused() -> None:
    tiff = encode(Image.new("RGB", (8, 8), COLOUR), "TIFF")
    url = "data:image/png;base64," + base64.b64encode(tiff).decode()
    data = parse_data_url(url)
    assert data == tiff
    with pytest.raises(ImageError, match=r"^image format TIFF is not allowed \(allowed: JPEG, PNG, WEBP, GIF, BMP\)$"):
        inspect_image(data, max_pixels=MAX_PIXELS)


def test_custom_allow_list() -> None:
    jpeg = encode(Image.new("RGB", (8, 8), COLOUR), "JPEG")
    with pytest.raises(ImageError) as err:
        inspect_image(jpeg, max_pixels=100, allowed_formats=("png",))
    assert str(err.value) == "image format JPEG is not allowed (allowed: PNG)"
    assert inspect_image(jpeg, max_pixels=100, allowed_formats=("jpg",)).format == "JPEG"
    with pytest.raises(ValueError, match="cannot open: NOPE"):
        inspect_image(jpeg, max_pixels=100, allowed_formats=("PNG", "NOPE"))


# --- limits and bombs ----------------------------------------------------------------------------------


def test_bomb_refused_fast_by_inspect_and_decode(bomb_400mp: bytes) -> None:
    assert len(bomb_400mp) < 100_000  # 400 megapixels in under 100 KB
    limit_before = Image.MAX_IMAGE_PIXELS
    for func in (inspect_image, decode_image):
        start = time.perf_counter()
        with pytest.raises(ImageError, match=r"^image is too large: .*exceeds the limit of \d+ pixels"):
            func(bomb_400mp, max_pixels=MAX_PIXELS)
        assert time.perf_counter() - start < 2.0
    assert limit_before == Image.MAX_IMAGE_PIXELS  # Pillow's global is left alone


def test_bomb_below_pillow_limit_refused_from_header(bomb_81mp: bytes, no_pixel_decoding: None) -> None:
    assert len(bomb_81mp) < 50_000
    expected = "image is too large: 9000x9000 (81000000 pixels) exceeds the limit of 50000000 pixels"
    for func in (inspect_image, decode_image):
        start = time.perf_counter()
        with pytest.raises(ImageError) as err:
            func(bomb_81mp, max_pixels=MAX_PIXELS)
        assert str(err.value) == expected
        assert time.perf_counter() - start < 2.0


def test_small_image_over_pixel_limit() -> None:
    data = encode(Image.new("RGB", (40, 30), COLOUR), "PNG")
    with pytest.raises(ImageError) as err:
        inspect_image(data, max_pixels=1199)
    assert str(err.value) == "image is too large: 40x30 (1200 pixels) exceeds the limit of 1199 pixels"
    assert inspect_image(data, max_pixels=1200).width == 40


def test_pillow_bomb_error_is_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    data = encode(Image.new("RGB", (100, 100), COLOUR), "PNG")
    with pytest.raises(ImageError) as err:
        decode_image(data, max_pixels=10**9)
    assert str(err.value) == (
        "image is too large: its pixel count exceeds the limit of 2000 pixels (possible decompression bomb)"
    )


def test_pillow_bomb_warning_as_error_is_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    data = encode(Image.new("RGB", (40, 40), COLOUR), "PNG")  # 1600 px: warning zone of Pillow
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ImageError) as err:
            inspect_image(data, max_pixels=10**9)
    assert str(err.value) == (
        "image is too large: its pixel count exceeds the limit of 1000 pixels (possible decompression bomb)"
    )


def test_max_bytes() -> None:
    data = encode(Image.new("RGB", (8, 8), COLOUR), "PNG")
    with pytest.raises(ImageError) as err:
        inspect_image(data, max_pixels=100, max_bytes=len(data) - 1)
    assert str(err.value) == f"image is too large: {len(data)} bytes exceeds the limit of {len(data) - 1} bytes"
    assert inspect_image(data, max_pixels=100, max_bytes=len(data)).size_bytes == len(data)


def test_load_truncated_images_flag_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    data = encode(Image.new("RGB", (8, 8), COLOUR), "PNG")
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_image(data, max_pixels=100)


# --- corrupt input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_file_refused(fmt: str) -> None:
    data = encode(noise_image(), fmt)
    cut = data[: len(data) // 2]
    for func in (inspect_image, decode_image):
        with pytest.raises(ImageError) as err:
            func(cut, max_pixels=MAX_PIXELS)
        assert str(err.value).startswith("image is truncated or corrupt: image file is truncated")


def test_png_with_broken_header_refused() -> None:
    cut_in_header = encode(Image.new("RGB", (8, 8), COLOUR), "PNG")[:20]
    with pytest.raises(ImageError) as err:
        inspect_image(cut_in_header, max_pixels=100)
    assert str(err.value) == "image is truncated or corrupt: Truncated File Read"

    garbage_after_signature = b"\x89PNG\r\n\x1a\n" + b"garbage!" * 8
    with pytest.raises(ImageError) as err:
        inspect_image(garbage_after_signature, max_pixels=100)
    assert str(err.value) == "image is truncated or corrupt: could not read the PNG header"


def test_random_bytes_refused() -> None:
    data = random.Random(1).randbytes(4096)
    for func in (inspect_image, decode_image):
        with pytest.raises(ImageError) as err:
            func(data, max_pixels=MAX_PIXELS)
        assert str(err.value) == f"data is not a recognized image (allowed formats: {ALLOWED_TEXT})"


def test_empty_bytes_refused() -> None:
    with pytest.raises(ImageError) as err:
        inspect_image(b"", max_pixels=100)
    assert str(err.value) == "image is empty (0 bytes)"


# --- mode conversion -----------------------------------------------------------------------------------


def test_cmyk_jpeg_to_rgb() -> None:
    im = Image.new("CMYK", (16, 8), (0, 255, 255, 0))  # pure red in CMYK
    im.paste((255, 0, 0, 0), (8, 0, 16, 8))  # pure cyan
    data = encode(im, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    out = decode_image(data, max_pixels=1000)
    assert out.mode == "RGB"
    assert_close(out.getpixel((2, 4)), RED, 8)
    assert_close(out.getpixel((13, 4)), (0, 255, 255), 8)


def test_16bit_grayscale_png_scaled_not_white() -> None:
    im = Image.new("I;16", (3, 1))
    for x, value in enumerate((0, 32768, 65535)):
        im.putpixel((x, 0), value)
    data = encode(im, "PNG")
    assert Image.open(io.BytesIO(data)).mode in ("I;16", "I")
    out = decode_image(data, max_pixels=100)
    assert out.mode == "RGB"
    assert [out.getpixel((x, 0)) for x in range(3)] == [BLACK, (128, 128, 128), WHITE]


def test_32bit_int_and_float_modes_scaled() -> None:
    in_16bit_range = Image.new("I", (1, 1), 32768)
    assert to_rgb(in_16bit_range).getpixel((0, 0)) == (128, 128, 128)

    wide = Image.new("I", (3, 1))
    for x, value in enumerate((-1000, 0, 1000)):
        wide.putpixel((x, 0), value)
    assert [to_rgb(wide).getpixel((x, 0)) for x in range(3)] == [BLACK, (128, 128, 128), WHITE]

    floats = Image.new("F", (3, 1))
    for x, level in enumerate((0.0, 0.5, 1.0)):
        floats.putpixel((x, 0), level)
    assert [to_rgb(floats).getpixel((x, 0)) for x in range(3)] == [BLACK, (128, 128, 128), WHITE]


def test_rgba_composited_onto_white() -> None:
    im = Image.new("RGBA", (3, 1))
    im.putpixel((0, 0), (10, 20, 30, 0))  # fully transparent
    im.putpixel((1, 0), (0, 0, 0, 128))  # half-transparent black
    im.putpixel((2, 0), (10, 20, 30, 255))  # opaque
    for fmt, params in (("PNG", {}), ("WEBP", {"lossless": True})):
        out = decode_image(encode(im, fmt, **params), max_pixels=100)
        assert out.mode == "RGB"
        assert out.getpixel((0, 0)) == WHITE
        assert_close(out.getpixel((1, 0)), (127, 127, 127), 1)
        assert out.getpixel((2, 0)) == (10, 20, 30)


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparency(fmt: str) -> None:
    im = Image.new("P", (2, 1), 0)
    im.putpalette([*RED, *GREEN])
    im.putpixel((1, 0), 1)
    data = encode(im, fmt, transparency=0)  # the red entry is transparent
    opened = Image.open(io.BytesIO(data))
    assert (opened.mode, opened.info["transparency"]) == ("P", 0)
    out = decode_image(data, max_pixels=100)
    assert out.getpixel((0, 0)) == WHITE
    assert out.getpixel((1, 0)) == GREEN


def test_palette_without_transparency() -> None:
    im = Image.new("P", (2, 1), 0)
    im.putpalette([*RED, *GREEN])
    im.putpixel((1, 0), 1)
    out = decode_image(encode(im, "PNG"), max_pixels=100)
    assert [out.getpixel((x, 0)) for x in range(2)] == [RED, GREEN]


def test_la_mode() -> None:
    im = Image.new("LA", (3, 1))
    im.putpixel((0, 0), (0, 0))  # transparent
    im.putpixel((1, 0), (0, 255))  # opaque black
    im.putpixel((2, 0), (200, 255))  # opaque grey
    data = encode(im, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "LA"
    out = decode_image(data, max_pixels=100)
    assert [out.getpixel((x, 0)) for x in range(3)] == [WHITE, BLACK, (200, 200, 200)]


def test_colour_key_transparency_in_rgb_png() -> None:
    im = Image.new("RGB", (2, 1), (1, 2, 3))
    im.putpixel((1, 0), (9, 9, 9))
    out = decode_image(encode(im, "PNG", transparency=(1, 2, 3)), max_pixels=100)
    assert [out.getpixel((x, 0)) for x in range(2)] == [WHITE, (9, 9, 9)]


@pytest.mark.parametrize("fmt", ["PNG", "BMP"])
def test_one_bit_and_grayscale(fmt: str) -> None:
    bilevel = Image.new("1", (2, 1), 0)
    bilevel.putpixel((1, 0), 1)
    out = decode_image(encode(bilevel, fmt), max_pixels=100)
    assert [out.getpixel((x, 0)) for x in range(2)] == [BLACK, WHITE]
    grey = decode_image(encode(Image.new("L", (1, 1), 77), fmt), max_pixels=100)
    assert grey.getpixel((0, 0)) == (77, 77, 77)


# --- orientation and animation -------------------------------------------------------------------------


def test_exif_orientation_6_rotates() -> None:
    im = Image.new("RGB", (40, 20), RED)
    im.paste(BLUE, (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    data = encode(im, "JPEG", quality=95, exif=exif.tobytes())

    info = inspect_image(data, max_pixels=1000)
    assert (info.width, info.height) == (40, 20)  # stored dimensions

    out = decode_image(data, max_pixels=1000)
    assert out.size == (20, 40)
    assert_close(out.getpixel((10, 5)), RED, 8)  # former left edge is now on top
    assert_close(out.getpixel((10, 35)), BLUE, 8)


def _animation(fmt: str, colours: list[tuple[int, int, int]], **params: object) -> bytes:
    frames = [Image.new("RGB", (8, 8), c) for c in colours]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, **params)


@pytest.mark.parametrize(("fmt", "params"), [("GIF", {}), ("WEBP", {"lossless": True})])
def test_animation_first_frame(fmt: str, params: dict[str, object]) -> None:
    data = _animation(fmt, [RED, GREEN, BLUE], **params)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3  # a plugin's attribute
    out = decode_image(data, max_pixels=100)
    assert out.mode == "RGB"
    assert out.size == (8, 8)
    assert out.getpixel((4, 4)) == RED


def test_too_many_frames_refused() -> None:
    data = _animation("GIF", [RED, GREEN, BLUE])
    with pytest.raises(ImageError) as err:
        decode_image(data, max_pixels=100, max_frames=2)
    assert str(err.value) == "image has 3 frames, more than the limit of 2"
    with pytest.raises(ImageError) as inspected:
        inspect_image(data, max_pixels=100, max_frames=2)
    assert str(inspected.value) == "image has 3 frames, more than the limit of 2"
    assert decode_image(data, max_pixels=100, max_frames=3).getpixel((0, 0)) == RED


def test_decoded_image_is_independent() -> None:
    data = encode(Image.new("RGB", (4, 4), COLOUR), "PNG")
    out = decode_image(data, max_pixels=100)
    assert getattr(out, "fp", None) is None  # holds no reference to the uploaded bytes
    out.putpixel((0, 0), BLACK)  # would fail on a closed or lazily loaded file-backed image
    assert out.getpixel((0, 0)) == BLACK
    assert out.getpixel((1, 1)) == COLOUR


# --- data URLs -----------------------------------------------------------------------------------------


def test_parse_data_url_good() -> None:
    payload = encode(Image.new("RGB", (4, 4), COLOUR), "PNG")
    b64 = base64.b64encode(payload).decode()
    assert parse_data_url(f"data:image/png;base64,{b64}") == payload
    assert parse_data_url(f"DATA:image/PNG;BASE64,{b64}") == payload
    assert parse_data_url(f"  data:image/png;base64,{b64[:10]}\n{b64[10:]}  ") == payload
    assert parse_data_url("data:;base64,AAEC") == b"\x00\x01\x02"
    # The declared type is not trusted or checked; the bytes are sniffed later.
    assert parse_data_url(f"data:text/plain;charset=utf-8;base64,{b64}") == payload


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", r"^not a data URL \(expected 'data:image/\.\.\.;base64,\.\.\.'"),
        ("data:image/png;base64", r"^not a data URL"),
        ("data:image/png,hello", r"^data URL is not base64-encoded"),
        ("data:base64,AAEC", r"^data URL is not base64-encoded"),
        ("data:image/png;base64,", r"^data URL contains no data$"),
        ("data:image/png;base64,@@@@", r"^data URL contains invalid base64: "),
        ("data:image/png;base64,AAA", r"^data URL contains invalid base64: "),
    ],
)
def test_parse_data_url_bad(url: str, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        parse_data_url(url)


def test_parse_data_url_error_does_not_echo_huge_input() -> None:
    with pytest.raises(ImageError) as err:
        parse_data_url("x" * 100_000)
    assert len(str(err.value)) < 200
