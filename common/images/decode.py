"""Validation and decoding of untrusted uploaded images.

Torch-free on purpose: the API process imports this to refuse unusable images at submit time, so a bad
upload fails fast with a clear message instead of reaching a GPU worker and failing a batch there.

Pillow's own safety switches (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``) are
process globals that any other library may change, so this module enforces its limits itself and only
treats Pillow's bomb check as a backstop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import re
import struct
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from common.images.structure import STRUCTURE_CHECKED_FORMATS, StructureError, check_structure

DEFAULT_ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

# Pillow reports multi-picture JPEGs (common from phone cameras) as MPO; they are JPEGs to users and to
# the allow-list, and their first picture is an ordinary JPEG.
_FORMAT_ALIASES = {"JPG": "JPEG", "MPO": "JPEG"}

# Everything Pillow's decoders are known to raise for malformed input. Image.open swallows some of these
# per plugin, but load(), seek() and n_frames do not.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    IndexError,
    KeyError,
    TypeError,
    ZeroDivisionError,
)

# Magic numbers, used only to *name* a refused format in the error message. Pillow is never asked to parse
# a format outside the allow-list, so exotic plugins never see untrusted bytes.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"II+\x00", "TIFF"),
    (b"MM\x00+", "TIFF"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG2000"),
    (b"\xff\x4f\xff\x51", "JPEG2000"),
    (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JXL"),
    (b"\xff\x0a", "JXL"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"qoif", "QOI"),
    (b"icns", "ICNS"),
    (b"DDS ", "DDS"),
    (b"\x00\x00\x01\x00", "ICO"),
)
_HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs", b"mif1", b"msf1"}
_AVIF_BRANDS = {b"avif", b"avis"}

# RFC 2397: "data:" [mediatype] *(";" param) [";base64"] "," payload; scheme and token are case-insensitive.
_DATA_URL_RE = re.compile(r"^data:(?P<header>[^,]*),(?P<payload>.*)$", re.IGNORECASE | re.DOTALL)
_WHITESPACE_RE = re.compile(r"\s+")


class ImageError(ValueError):
    """Input image is unusable; ``str(e)`` is a clear message that can be shown to the user as is."""


@dataclass(frozen=True)
class ImageInfo:
    """What submit-time validation learned about an upload.

    ``width``/``height`` are the stored dimensions from the header; EXIF orientation is applied only by
    ``decode_image``, so a portrait phone photo may be reported here as landscape.
    """

    sha256: str  # hex digest of the raw bytes as uploaded, so identical uploads can be deduplicated
    format: str  # Pillow format name: JPEG, PNG, WEBP, GIF, BMP
    width: int
    height: int
    size_bytes: int


def image_pixels(data: bytes, *, max_pixels: int, allowed_formats: Collection[str] = DEFAULT_ALLOWED_FORMATS
                 ) -> int:
    """Width x height from the header alone, nothing decoded; raises ImageError as decode_image would for a
    format or size it refuses."""
    with _open_checked(data, _normalize_formats(allowed_formats), max_pixels) as im:
        width, height = im.size
    return int(width * height)


def inspect_image(
    data: bytes,
    *,
    max_pixels: int,
    allowed_formats: Collection[str] = DEFAULT_ALLOWED_FORMATS,
    max_bytes: int | None = None,
    max_frames: int | None = None,
    check: Literal["decode", "structure"] = "decode",
) -> ImageInfo:
    """Validate an upload cheaply enough for the API process and describe it.

    The format is identified from the bytes, never from a file name or declared content type. The pixel
    limit is checked from the header before any pixel is decoded, so a few-KB PNG declaring 400 megapixels
    is refused fast and with little memory. Then truncated or corrupt files are caught: with ``check="decode"``
    by decoding the first frame; with ``"structure"``, for PNG and JPEG, by reading the container without
    decoding pixels (common/images/structure.py; other formats are decoded). ``max_frames`` (optional) applies
    the same frame limit as ``decode_image`` so a job is not accepted only to fail on the worker. Raises
    ImageError.
    """
    allowed = _normalize_formats(allowed_formats)
    _check_limits(max_pixels=max_pixels, max_frames=max_frames)
    _require_strict_loading()
    _check_size(data, max_bytes)
    with _open_checked(data, allowed, max_pixels) as im:
        if max_frames is not None:
            _check_frames(im, max_frames, max_pixels)
        fmt = _canonical_format(im.format)
        if not (check == "structure" and fmt in STRUCTURE_CHECKED_FORMATS and _checked_by_structure(data, fmt)):
            _load(im, max_pixels)
        width, height = im.size
    return ImageInfo(
        sha256=hashlib.sha256(data).hexdigest(),
        format=fmt,
        width=width,
        height=height,
        size_bytes=len(data),
    )


def decode_image(
    data: bytes,
    *,
    max_pixels: int,
    allowed_formats: Collection[str] = DEFAULT_ALLOWED_FORMATS,
    max_frames: int = 1000,
) -> Image.Image:
    """Decode an upload to an RGB image ready for a model processor.

    Applies the same checks as ``inspect_image``, then EXIF orientation; animated images yield their first
    frame (refused above ``max_frames``); every mode is converted to 8-bit RGB (see ``to_rgb``). The result
    is fully loaded and independent of ``data``. Raises ImageError.
    """
    allowed = _normalize_formats(allowed_formats)
    _check_limits(max_pixels=max_pixels, max_frames=max_frames)
    _require_strict_loading()
    _check_size(data, None)
    with _open_checked(data, allowed, max_pixels) as im:
        _check_frames(im, max_frames, max_pixels)
        _load(im, max_pixels)
        oriented = _apply_exif_orientation(im)
    return to_rgb(oriented)


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert a loaded image of any Pillow mode to 8-bit RGB.

    Transparency is composited onto white, because models see black-on-transparent line art as black on
    black when the alpha channel is simply dropped. High-bit-depth modes are scaled, not clipped: Pillow's
    plain ``convert("L")`` clips 16-bit values, which turns almost every 16-bit image white. Returns ``im``
    itself when it already is RGB without transparency.
    """
    mode = im.mode
    if mode.startswith("I;16"):
        # The nominal depth is known to be 16 bits, so scale by it rather than by the content's range.
        return _scale_to_8bit(im.convert("I"), 0.0, 65535.0)
    if mode == "I":
        low, high = _extrema(im)
        if low >= 0 and high <= 65535:
            # The only allowed source of mode I is 16-bit PNG (older Pillow versions), which holds 0..65535.
            return _scale_to_8bit(im, 0.0, 65535.0)
        # Genuinely 32-bit data has no nominal range; stretching keeps its content visible.
        return _scale_to_8bit(im, float(low), float(high))
    if mode == "F":
        low, high = _extrema(im)
        if low >= 0 and high <= 1:
            # Float images conventionally hold 0..1.
            return _scale_to_8bit(im, 0.0, 1.0)
        return _scale_to_8bit(im, float(low), float(high))
    if mode == "RGB" and "transparency" not in im.info:
        return im
    has_alpha = "A" in im.getbands() or "a" in im.getbands()
    palette_alpha = mode == "P" and im.palette is not None and im.palette.mode == "RGBA"
    if has_alpha or palette_alpha or "transparency" in im.info:
        # convert("RGBA") applies PNG/GIF tRNS palette indices and colour keys and un-premultiplies
        # RGBa/La; compositing then replaces transparency with white.
        rgba = _convert(im, "RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    # Covers 1, L, P, CMYK (Pillow already un-inverts Adobe CMYK JPEGs), YCbCr, LAB, HSV, RGBX.
    return _convert(im, "RGB")


def parse_data_url(url: str) -> bytes:
    """Return the payload of a base64 ``data:`` URL such as ``data:image/png;base64,iVBOR...``.

    The declared media type is deliberately ignored: it is the sender's claim, and the bytes are sniffed
    by ``inspect_image``/``decode_image`` anyway. Raises ImageError.
    """
    if not isinstance(url, str):
        raise ImageError(f"expected a data URL string, got {type(url).__name__}")
    match = _DATA_URL_RE.match(url.strip())
    if match is None:
        raise ImageError(f"not a data URL (expected 'data:image/...;base64,...', got {_preview(url)!r})")
    params = [p.strip().lower() for p in match["header"].split(";")]
    if "base64" not in params[1:]:
        raise ImageError("data URL is not base64-encoded (expected 'data:image/...;base64,...')")
    # Clients and copy-paste commonly wrap long base64 text; whitespace is never part of the alphabet.
    payload = _WHITESPACE_RE.sub("", match["payload"])
    if not payload:
        raise ImageError("data URL contains no data")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data URL contains invalid base64: {e}") from e


def _normalize_formats(allowed_formats: Collection[str]) -> tuple[str, ...]:
    # A bare string would otherwise be iterated character by character and allow nothing.
    return _normalized_formats((allowed_formats,) if isinstance(allowed_formats, str) else tuple(allowed_formats))


_plugins_lock = threading.Lock()


def register_image_plugins() -> None:
    """Import every Pillow plugin now (a process's warm-up) rather than on its first image. Under a lock: a
    worker's first jobs arrive on many threads at once, and each would import every plugin, queueing on the
    import locks."""
    with _plugins_lock:
        Image.init()


@functools.lru_cache(maxsize=64)
def _normalized_formats(names: tuple[str, ...]) -> tuple[str, ...]:
    """Checked once per list of names: every image of every job names the same one."""
    allowed = tuple(dict.fromkeys(_canonical_format(name) for name in names))
    if not allowed:
        raise ValueError("allowed_formats must name at least one format")
    # A typo in configuration would otherwise surface as a KeyError inside Image.open and be reported to
    # users as a corrupt image.
    register_image_plugins()
    unknown = [name for name in allowed if name not in Image.OPEN]
    if unknown:
        raise ValueError(f"allowed_formats names formats Pillow cannot open: {', '.join(unknown)}")
    return allowed


def _canonical_format(name: str | None) -> str:
    upper = (name or "").upper()
    return _FORMAT_ALIASES.get(upper, upper)


def _check_limits(*, max_pixels: int, max_frames: int | None) -> None:
    # These come from configuration, not from the user, so a bad value is a programming error.
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    if max_frames is not None and max_frames <= 0:
        raise ValueError(f"max_frames must be positive, got {max_frames}")


def _require_strict_loading() -> None:
    # With this flag set, Pillow silently pads truncated files with grey and every corrupt-file check here
    # would pass. It is a process global another library may have flipped; failing loudly beats silently
    # feeding half-grey images to a model.
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process; common.images.decode refuses to run "
            "because truncated images would be accepted"
        )


def _check_size(data: bytes, max_bytes: int | None) -> None:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageError(f"image data must be bytes, got {type(data).__name__}")
    size = len(data)
    if size == 0:
        raise ImageError("image is empty (0 bytes)")
    if max_bytes is not None and size > max_bytes:
        raise ImageError(f"image is too large: {size} bytes exceeds the limit of {max_bytes} bytes")


def _sniff_format(data: bytes) -> str | None:
    head = bytes(data[:64])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _AVIF_BRANDS:
            return "AVIF"
        if brand in _HEIF_BRANDS:
            return "HEIF"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    text = bytes(data[:512]).lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"<svg") or (text.startswith(b"<?xml") and b"<svg" in text):
        return "SVG"
    return None


def _allowed_text(allowed: tuple[str, ...]) -> str:
    return ", ".join(allowed)


@contextmanager
def _pillow_errors(max_pixels: int) -> Iterator[None]:
    """Translate whatever Pillow raises for hostile or damaged input into ImageError."""
    try:
        yield
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Only reachable when Pillow's global limit is below ours (or its warning is configured as an
        # error); report whichever limit actually refused the image.
        pillow_limit = Image.MAX_IMAGE_PIXELS or max_pixels
        if isinstance(e, Image.DecompressionBombError):
            pillow_limit *= 2
        limit = min(max_pixels, pillow_limit)
        raise ImageError(
            f"image is too large: its pixel count exceeds the limit of {limit} pixels (possible decompression bomb)"
        ) from e
    except _DECODE_ERRORS as e:
        detail = str(e) or type(e).__name__
        raise ImageError(f"image is truncated or corrupt: {detail}") from e


def _open_checked(data: bytes, allowed: tuple[str, ...], max_pixels: int) -> ImageFile.ImageFile:
    """Open (header only) and enforce format and pixel limits before anything is decoded."""
    sniffed = _sniff_format(data)
    if sniffed is not None and sniffed not in allowed:
        raise ImageError(f"image format {sniffed} is not allowed (allowed: {_allowed_text(allowed)})")
    with _pillow_errors(max_pixels):
        try:
            im = Image.open(io.BytesIO(data), formats=allowed)
        except UnidentifiedImageError as e:
            # Pillow's message only names the BytesIO object, which helps nobody.
            if sniffed is not None:
                raise ImageError(f"image is truncated or corrupt: could not read the {sniffed} header") from e
            raise ImageError(f"data is not a recognized image (allowed formats: {_allowed_text(allowed)})") from e
    try:
        fmt = _canonical_format(im.format)
        # Belt and braces: a plugin factory may return a different format than the one it was asked for.
        if fmt not in allowed:
            raise ImageError(f"image format {fmt} is not allowed (allowed: {_allowed_text(allowed)})")
        width, height = im.size
        if width <= 0 or height <= 0:
            raise ImageError(f"image has invalid dimensions {width}x{height}")
        if width * height > max_pixels:
            raise ImageError(
                f"image is too large: {width}x{height} ({width * height} pixels) exceeds the limit of "
                f"{max_pixels} pixels"
            )
    except BaseException:
        im.close()
        raise
    return im


def _checked_by_structure(data: bytes, fmt: str) -> bool:
    """True: the container is whole; False: too unusual to check that way (decode it). Raises ImageError."""
    try:
        return check_structure(data, fmt)
    except StructureError as e:
        raise ImageError(f"image is truncated or corrupt: {e}") from e


def _check_frames(im: Image.Image, max_frames: int, max_pixels: int) -> None:
    with _pillow_errors(max_pixels):
        # GIF frames are counted by walking block headers without decoding pixels, so this stays cheap;
        # max_bytes bounds how many headers there can be.
        n_frames = getattr(im, "n_frames", 1)
        if n_frames > max_frames:
            raise ImageError(f"image has {n_frames} frames, more than the limit of {max_frames}")
        if n_frames > 1:
            im.seek(0)


def _load(im: Image.Image, max_pixels: int) -> None:
    with _pillow_errors(max_pixels):
        im.load()


def _apply_exif_orientation(im: Image.Image) -> Image.Image:
    # In place: the image is this module's own, and a copy of a photo that needs no turn (most) would cost as
    # much as its decode. Leaving the `with` of its opening only drops the file, never the loaded pixels.
    # Cameras and editors write plenty of malformed EXIF; a broken orientation tag is no reason to reject pixels
    # that decoded fine, so such an image is used as stored.
    with suppress(*_DECODE_ERRORS):
        ImageOps.exif_transpose(im, in_place=True)
    return im


def _extrema(im: Image.Image) -> tuple[float, float]:
    extrema = im.getextrema()
    return float(extrema[0]), float(extrema[1])  # type: ignore[arg-type]


def _scale_to_8bit(im: Image.Image, low: float, high: float) -> Image.Image:
    """Map [low, high] linearly onto 0..255 (rounded, clipped) and return RGB."""
    if high <= low:
        # Flat image: there is no range to stretch, so pass the value through and let the L conversion
        # clip it.
        scale, offset = 1.0, 0.0
    else:
        scale = 255.0 / (high - low)
        offset = -low * scale
    # Pillow evaluates point() lambdas symbolically for I/F modes, so only a linear expression works; the
    # +0.5 rounds instead of truncating. Converting the result to L clips to 0..255.
    scaled = im.point(lambda v: v * scale + (offset + 0.5))
    return scaled.convert("L").convert("RGB")


def _convert(im: Image.Image, mode: str) -> Image.Image:
    try:
        return im.convert(mode)
    except ValueError as e:
        raise ImageError(f"image mode {im.mode} cannot be converted to {mode}: {e}") from e


def _preview(text: str, limit: int = 40) -> str:
    # Never echo a multi-megabyte payload back in an error message.
    return text if len(text) <= limit else text[:limit] + "..."
