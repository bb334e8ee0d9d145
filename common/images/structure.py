"""Checking an image file's structure without decoding its pixels, for submit-time validation.

Decoding a photo costs the API much of a request's CPU, and the worker decodes it again to run the job. What a file
that fails to decode usually has wrong is its container: it was cut short in transit or on disk, or bytes were
flipped. Those are found by reading the container alone:

- PNG: every chunk's CRC-32 is checked, up to the IEND chunk (Pillow's ``verify``), so truncation and flipped
  bytes anywhere in the file, pixel data included, are refused.
- JPEG: the markers are walked from SOI through every segment and entropy-coded scan to EOI, so a file cut
  anywhere before its end-of-image marker, or with a segment running past the end, is refused.

Not caught: a file crafted with valid checksums around a broken compressed stream. Such an image is accepted,
and its job fails in the worker with ``invalid_input`` and the decoder's message. Callers decode what this
module does not check: other formats, and a JPEG with more markers than a camera writes, which this walk (a
Python loop, where the decoder's is C) would read more slowly than the decoder.
"""

from __future__ import annotations

import io
import re

from PIL import Image

# The formats whose structure this module can check.
STRUCTURE_CHECKED_FORMATS = ("PNG", "JPEG")

# Inside entropy-coded data 0xFF is followed by 0x00 (byte stuffing) or by a restart marker (D0-D7); any
# other byte after it (0xFF aside, a fill byte) makes a marker, which ends the scan. Written without repeats or
# lookahead, the pattern is matched at C speed; with them the regex engine steps through every byte.
_SCAN_END = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
_FILL = re.compile(rb"\xff+")
# Markers that stand alone, without a length: TEM and RST0-7 (SOI and EOI are handled explicitly).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
_SOF = frozenset({*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), *range(0xCD, 0xD0)})
_SOI, _EOI, _SOS = 0xD8, 0xD9, 0xDA
# Cameras write tens of markers (progressive files ~10-20 scans, with their tables); 20 MB of 4-byte segments
# would be millions.
MAX_JPEG_MARKERS = 4096


class StructureError(ValueError):
    """The file's container is broken; ``str(e)`` says where."""


def check_structure(data: bytes, fmt: str) -> bool:
    """Check the container of an image Pillow has already opened as ``fmt`` (PNG or JPEG).

    Returns True when the file is whole, False when it is too unusual to check this way (decode it instead).
    Raises StructureError for a broken file, ValueError for a format this module cannot check.
    """
    if fmt == "PNG":
        _check_png(data)
        return True
    if fmt == "JPEG":
        return _check_jpeg(data)
    raise ValueError(f"no structural check for {fmt}; decode it instead")


def _check_png(data: bytes) -> None:
    # verify() reads chunk after chunk from the first IDAT to IEND, checking each one's CRC, and raises for a
    # bad CRC or a missing IEND; it needs a freshly opened file.
    try:
        with Image.open(io.BytesIO(data), formats=("PNG",)) as im:
            im.verify()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise StructureError(str(e) or type(e).__name__) from e


def _check_jpeg(data: bytes) -> bool:
    """Walk SOI, segments, scans and EOI; False past MAX_JPEG_MARKERS. Bytes after EOI are allowed: MPO files
    carry a second picture there, and some cameras append their own trailers."""
    view = memoryview(data)
    size = len(data)
    if size < 4 or view[0] != 0xFF or view[1] != _SOI:
        raise StructureError("JPEG does not start with an SOI marker")
    pos, frames, scans = 2, 0, 0
    for _ in range(MAX_JPEG_MARKERS):
        if pos >= size:
            raise StructureError(f"JPEG ends after {size} bytes without an end-of-image marker")
        if view[pos] != 0xFF:
            raise StructureError(f"JPEG has no marker where one is due (byte {pos})")
        pos = _FILL.match(data, pos).end()  # type: ignore[union-attr]  # fill bytes may precede a marker
        if pos >= size:
            raise StructureError(f"JPEG ends after {size} bytes without an end-of-image marker")
        marker = view[pos]
        pos += 1
        if marker == _EOI:
            if not scans:
                raise StructureError("JPEG has no image data (no scan before its end-of-image marker)")
            return True
        if marker in _STANDALONE:
            continue
        if marker in (0x00, _SOI):
            raise StructureError(f"JPEG has an invalid marker 0xFF{marker:02X} at byte {pos - 2}")
        if pos + 2 > size:
            raise StructureError(f"JPEG is truncated inside a segment header (byte {pos})")
        length = (view[pos] << 8) | view[pos + 1]
        if length < 2 or pos + length > size:
            raise StructureError(f"JPEG segment 0xFF{marker:02X} at byte {pos - 2} runs past the end of the file")
        pos += length
        if marker in _SOF:
            frames += 1
        elif marker == _SOS:
            if not frames:
                raise StructureError("JPEG has a scan before its frame header")
            scans += 1
            end = _SCAN_END.search(data, pos)
            if end is None:
                raise StructureError(f"JPEG is truncated inside its scan {scans} (no marker after byte {pos})")
            pos = end.start()
    return False
