"""RGB images packed into arrays in one pass: equal to numpy's own conversion, writable, and the processors of
every family compute the same pixel values from them as from the PIL images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.worker.inference.test_image_resize import PROCESSORS, photo
from worker.inference.image_array import for_processor, to_array
from worker.inference.image_resize import use_torch_resize


@pytest.mark.parametrize(("height", "width"), [(1, 1), (1, 7), (3, 3), (5, 1), (224, 224), (1200, 1600),
                                               (333, 121), (2, 70_000)])
def test_equal_to_numpys_conversion(height: int, width: int) -> None:
    image = Image.fromarray(photo(height, width, seed=height + width))
    array = to_array(image)
    assert array.dtype == np.uint8 and array.shape == (height, width, 3)
    assert np.array_equal(array, np.array(image))
    assert array.flags.writeable and array.flags.c_contiguous and array.flags.owndata


def test_every_row_of_a_tall_and_a_wide_image() -> None:
    # Wider than the 64 KB the chunked conversion packs at once, and many rows: a row's bytes must not shift.
    for height, width in ((50_000, 3), (4, 30_000)):
        pixels = np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8)
        assert np.array_equal(to_array(Image.fromarray(pixels)), pixels)


def test_a_decoded_file_and_a_cropped_view() -> None:
    image = Image.fromarray(photo(300, 400, seed=3))
    cropped = image.crop((17, 5, 301, 250))  # a new image of its own size, not a view with an offset
    assert np.array_equal(to_array(cropped), np.array(cropped))


def test_only_rgb() -> None:
    with pytest.raises(ValueError, match="expected an RGB image, got mode RGBA"):
        to_array(Image.new("RGBA", (4, 4)))


@pytest.mark.parametrize("resize", ["torch", "pillow"])
@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_processors_compute_the_same_from_the_array(name: str, resize: str) -> None:
    # 3 and 1 rows: shapes whose array HF's channel guess reads as channels-first; for_processor keeps them PIL.
    images = [Image.fromarray(photo(900, 1300, seed=1)), Image.fromarray(photo(333, 120, seed=2)),
              Image.fromarray(photo(3, 40, seed=4)), Image.fromarray(photo(1, 30, seed=5))]
    use_torch_resize(resize == "torch")
    try:
        from_pil = PROCESSORS[name]()(images=images, return_tensors="pt")
        from_arrays = PROCESSORS[name]()(images=[for_processor(im) for im in images], return_tensors="pt")  # type: ignore[arg-type]
    finally:
        use_torch_resize(True)
    assert set(from_arrays.keys()) == set(from_pil.keys())
    for key in from_pil:
        assert torch.equal(from_arrays[key], from_pil[key]), key


def test_only_shapes_hf_reads_right_become_arrays() -> None:
    for height in (1, 3):
        image = Image.new("RGB", (40, height))
        assert for_processor(image) is image
    for height in (2, 4, 224):
        assert isinstance(for_processor(Image.new("RGB", (3, height))), np.ndarray)
