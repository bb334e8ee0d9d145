"""Tests for common.images.structure and inspect_image(check="structure"): broken containers are refused
without decoding a pixel, and what the structural check lets through is what the worker's decode handles."""

from __future__ import annotations

import io
import random
import struct
import zlib

import pytest
from PIL import Image

from common.images.decode import ImageError, decode_image, inspect_image
from common.images.structure import MAX_JPEG_MARKERS, StructureError, check_structure
from tests.common.images.test_decode import _chunk, encode, no_pixel_decoding, noise_image  # noqa: F401 (fixture)

MAX_PIXELS = 50_000_000


def photo(size: tuple[int, int] = (96, 64), seed: int = 0) -> Image.Image:
    # Smooth content plus noise, as a photo: its JPEG scans hold plenty of 0xFF00 stuffing.
    rng = random.Random(seed)
    im = Image.linear_gradient("L").resize(size).convert("RGB")
    noise = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    return Image.blend(im, noise, 0.3)


JPEG_VARIANTS = [
    ("baseline", {"quality": 90}),
    ("progressive", {"quality": 90, "progressive": True}),
    ("restart markers", {"quality": 90, "restart_marker_blocks": 1}),
    ("4:4:4, exif", {"quality": 95, "subsampling": 0, "exif": Image.Exif()}),
]


def png_with_checked_but_broken_pixels(size: tuple[int, int] = (32, 32)) -> bytes:
    """A PNG whose chunks all carry correct CRCs, but whose IDAT is not a valid zlib stream: only decoding
    can tell (it is what a crafted file looks like)."""
    raw = bytearray(zlib.compress(b"\x00" * (size[1] * (1 + 3 * size[0]))))
    raw[0] = 0x00  # an invalid zlib header (compression method 0)
    return b"".join([
        b"\x89PNG\r\n\x1a\n",
        _chunk(b"IHDR", struct.pack(">IIBBBBB", size[0], size[1], 8, 2, 0, 0, 0)),
        _chunk(b"IDAT", bytes(raw)),
        _chunk(b"IEND", b""),
    ])


# --- whole files pass, without decoding ------------------------------------------------------------------


@pytest.mark.usefixtures("no_pixel_decoding")
@pytest.mark.parametrize(("name", "params"), JPEG_VARIANTS)
def test_whole_jpeg_passes_without_decoding(name: str, params: dict[str, object]) -> None:
    data = encode(photo(), "JPEG", **params)
    assert data.count(b"\xff\x00") > 0  # the scan really holds stuffed bytes
    if name == "restart markers":
        assert any(bytes([0xFF, m]) in data for m in range(0xD0, 0xD8))
    info = inspect_image(data, max_pixels=MAX_PIXELS, check="structure")
    assert (info.format, info.width, info.height) == ("JPEG", 96, 64)


@pytest.mark.usefixtures("no_pixel_decoding")
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "I;16"])
def test_whole_png_passes_without_decoding(mode: str) -> None:
    image = photo().convert("L").convert("I;16") if mode == "I;16" else photo().convert(mode)
    data = encode(image, "PNG")
    assert inspect_image(data, max_pixels=MAX_PIXELS, check="structure").format == "PNG"


def test_animated_png_passes() -> None:
    frames = [photo(seed=i) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "PNG", save_all=True, append_images=frames[1:])
    info = inspect_image(buf.getvalue(), max_pixels=MAX_PIXELS, max_frames=5, check="structure")
    assert info.format == "PNG"


def test_jpeg_fill_bytes_and_trailing_data_pass() -> None:
    data = encode(photo(), "JPEG", quality=90)
    eoi = data.rindex(b"\xff\xd9")
    padded = data[:eoi] + b"\xff\xff\xff" + data[eoi:]  # fill bytes before a marker are legal
    check_structure(padded, "JPEG")
    check_structure(data + b"camera trailer" * 10, "JPEG")  # bytes after EOI, as cameras append


def test_multi_picture_jpeg_passes() -> None:
    buf = io.BytesIO()
    photo(seed=1).save(buf, "MPO", save_all=True, append_images=[photo(seed=2)])
    info = inspect_image(buf.getvalue(), max_pixels=MAX_PIXELS, max_frames=5, check="structure")
    assert info.format == "JPEG"


# --- broken files are refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_every_truncation_refused(fmt: str) -> None:
    data = encode(photo(), fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    # Every cut past the header, which Pillow needs to open the file at all (a cut inside it fails there), that
    # loses part of the PNG's IEND chunk type or more; IEND's own CRC, after it, is read by neither check.
    last = len(data) - (5 if fmt == "PNG" else 1)
    for cut in range(last, 200, -7):
        with pytest.raises(ImageError, match=r"^image is truncated or corrupt: "):
            inspect_image(data[:cut], max_pixels=MAX_PIXELS, check="structure")


@pytest.mark.usefixtures("no_pixel_decoding")
def test_png_flipped_pixel_byte_refused() -> None:
    data = bytearray(encode(noise_image(), "PNG"))
    idat = data.index(b"IDAT")
    data[idat + 4 + 100] ^= 0x01
    with pytest.raises(ImageError, match=r"^image is truncated or corrupt: .*checksum"):
        inspect_image(bytes(data), max_pixels=MAX_PIXELS, check="structure")


def test_png_without_iend_refused() -> None:
    data = encode(noise_image(), "PNG")
    assert data.endswith(_chunk(b"IEND", b""))
    with pytest.raises(ImageError, match=r"^image is truncated or corrupt"):
        inspect_image(data[:-12], max_pixels=MAX_PIXELS, check="structure")


def test_jpeg_broken_markers_refused() -> None:
    data = encode(photo(), "JPEG", quality=90)
    sos = data.index(b"\xff\xda")
    with pytest.raises(StructureError, match=r"without an end-of-image marker|truncated inside its scan"):
        check_structure(data[:-2], "JPEG")
    long_segment = data[:sos] + b"\xff\xfe\xff\xff" + b"comment"  # a COM segment claiming 65,535 bytes
    with pytest.raises(StructureError, match="runs past the end"):
        check_structure(long_segment, "JPEG")
    after_app0 = 4 + int.from_bytes(data[4:6], "big")
    with pytest.raises(StructureError, match="no marker where one is due"):
        check_structure(data[:after_app0] + b"\x00" + data[after_app0:], "JPEG")
    with pytest.raises(StructureError, match="does not start with an SOI"):
        check_structure(data[2:], "JPEG")
    header_only = data[:sos] + b"\xff\xd9"
    with pytest.raises(StructureError, match="no image data"):
        check_structure(header_only, "JPEG")


def test_other_formats_are_decoded() -> None:
    # GIF, WebP and BMP have no structural check here: a truncated one is found by decoding it.
    for fmt in ("GIF", "WEBP", "BMP"):
        data = encode(noise_image(), fmt)
        cut = data[: len(data) * 3 // 4]
        with pytest.raises(ImageError, match=r"^image is truncated or corrupt"):
            inspect_image(cut, max_pixels=MAX_PIXELS, check="structure")
    with pytest.raises(ValueError, match="no structural check for GIF"):
        check_structure(encode(noise_image(), "GIF"), "GIF")


def test_jpeg_of_too_many_markers_is_decoded_instead() -> None:
    """A walk in Python over a file of millions of markers would cost more than libjpeg's in C: past
    MAX_JPEG_MARKERS the image is decoded, and judged by that."""
    data = encode(photo(), "JPEG", quality=90)
    comments = b"\xff\xfe\x00\x02" * MAX_JPEG_MARKERS  # empty COM segments, legal anywhere before the scan
    crowded = data[:2] + comments + data[2:]
    assert check_structure(crowded, "JPEG") is False
    assert inspect_image(crowded, max_pixels=MAX_PIXELS, check="structure").format == "JPEG"
    cut = crowded[:-100]
    assert check_structure(cut, "JPEG") is False
    with pytest.raises(ImageError, match=r"^image is truncated or corrupt"):
        inspect_image(cut, max_pixels=MAX_PIXELS, check="structure")  # refused by the decode
    filled = data[:2] + b"\xff" * 5_000_000 + data[2:]  # fill bytes are skipped at C speed
    assert check_structure(filled, "JPEG") is True


# --- what passes the container check but not a decode ------------------------------------------------------


def test_checked_container_with_broken_pixels_is_left_to_the_decode() -> None:
    data = png_with_checked_but_broken_pixels()
    assert inspect_image(data, max_pixels=MAX_PIXELS, check="structure").format == "PNG"
    with pytest.raises(ImageError, match=r"^image is truncated or corrupt"):
        inspect_image(data, max_pixels=MAX_PIXELS, check="decode")
    with pytest.raises(ImageError, match=r"^image is truncated or corrupt"):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_structure_and_decode_agree_on_damaged_files() -> None:
    """Random damage: cuts, and flipped bytes. Whenever the full decode refuses a cut file, or a PNG with a
    flipped byte (every byte of a PNG is checksummed), the structural check refuses it too; and damage of any
    kind gives ImageError or nothing, never another exception."""
    rng = random.Random(7)
    originals = {"PNG": encode(photo(), "PNG"), "JPEG": encode(photo(), "JPEG", quality=90)}
    for _ in range(400):
        fmt = rng.choice(["PNG", "JPEG"])
        data = bytearray(originals[fmt])
        flipped = rng.random() < 0.5
        if flipped:
            data[rng.randrange(60, len(data))] ^= 1 << rng.randrange(8)
        else:
            del data[rng.randrange(200, len(data)):]
        refused = {}
        for check in ("decode", "structure"):
            try:
                inspect_image(bytes(data), max_pixels=MAX_PIXELS, check=check)
                refused[check] = False
            except ImageError:
                refused[check] = True
        if fmt == "PNG" or not flipped:
            assert refused["structure"] or not refused["decode"], (fmt, flipped, len(data))
