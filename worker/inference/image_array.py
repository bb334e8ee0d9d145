"""RGB PIL images as the HWC uint8 arrays HF processors start from, packed in one pass.

An HF processor given a PIL image turns it into an array with `np.array(image)`, which goes through Pillow's
`tobytes()`: that packs the pixels (4 bytes each inside Pillow, 3 in the array) 64 KB at a time into fresh
buffers, joins them, and numpy copies the result, on the order of what resizing the photo costs now
(worker/inference/image_resize.py). Pillow's raw encoder asked for the whole image at once packs it in one call: the
same bytes, with one copy fewer and no joins. Given the array, the processor skips
its own conversion and computes the same pixel values (tests/worker/inference/test_image_array.py; the token-identity
tests with HF, which hand HF the PIL images, run through this too).

One exception: HF guesses an array's channel axis from its shape, and an image 1 or 3 pixels tall is an
array whose first and last axes could both be channels, which it takes as channels-first. Such an image (a
few bytes) stays a PIL image, whose layout HF knows.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# Heights at which an HWC array's first axis looks like a channel axis to HF's `infer_channel_dimension_format`.
_AMBIGUOUS_HEIGHTS = (1, 3)


def for_processor(image: Image.Image) -> np.ndarray | Image.Image:
    """What to hand an HF processor for an RGB image: its array, or the image itself where HF would misread
    the array's layout."""
    return image if image.height in _AMBIGUOUS_HEIGHTS else to_array(image)


def to_array(image: Image.Image) -> np.ndarray:
    """An RGB image's pixels as a new, writable (height, width, 3) uint8 array; equal to `np.array(image)`."""
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode}")
    image.load()
    width, height = image.size
    if not width or not height:
        return np.zeros((height, width, 3), np.uint8)
    # Image._getencoder is what tobytes() itself calls; here it is given room for the whole image, so the raw
    # encoder packs every row in one call instead of 64 KB per call.
    encoder = Image._getencoder("RGB", "raw", ("RGB", 0, 1))
    try:
        encoder.setimage(image.im, (0, 0, width, height))
        _, status, data = encoder.encode(width * height * 3 + 1)
    finally:
        encoder.cleanup()
    if status != 1 or len(data) != width * height * 3:  # 1: the whole image was written
        return np.array(image)
    # bytes are immutable, so the array over them is read-only; processors (and torch.from_numpy) want to own
    # a writable one, and this copy is the only one made.
    return np.frombuffer(data, np.uint8).reshape(height, width, 3).copy()
