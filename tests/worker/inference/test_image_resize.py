"""The image processors' resize through torch's antialiased kernel: what HF's torchvision processors compute,
within a pixel level of Pillow, used by every PIL-backed processor family, and Pillow wherever it cannot stand in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    CLIPImageProcessorPil,
    GotOcr2ImageProcessorPil,
    Qwen2VLImageProcessorPil,
    SiglipImageProcessorPil,
)
from transformers.image_transforms import resize as pillow_resize
from transformers.image_utils import ChannelDimension, PILImageResampling

from worker.inference import image_resize
from worker.inference.image_resize import resize_uint8, torch_resize_in_use, use_torch_resize
from worker.inference.model_loader import load_model


@pytest.fixture(autouse=True)
def restore_default() -> Iterator[None]:
    yield
    use_torch_resize(True)  # the loader's default, which the rest of the suite runs with


def photo(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus sensor-like noise: content where filters and rounding both show."""
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 180, height), np.linspace(0, 60, width))[..., None]
    return (ramp + rng.normal(0, 25, (height, width, channels))).clip(0, 255).astype(np.uint8)


PROCESSORS = {
    "clip": lambda: CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),
    "siglip": lambda: SiglipImageProcessorPil(size={"height": 96, "width": 96}),
    "qwen2_vl": lambda: Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224),
    "got_ocr2": lambda: GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=True,
                                                 max_patches=4),
}


def levels_apart(ours: np.ndarray, pillow: np.ndarray) -> np.ndarray:
    return np.abs(ours.astype(int) - pillow.astype(int))


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_a_photo_shrunk_to_a_vision_tower_is_pillows_within_a_level(channels: int, mode: str) -> None:
    image = photo(1200, 1600, channels=channels)
    filters = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
    pil = Image.fromarray(image.squeeze(-1) if channels == 1 else image, {1: "L", 3: "RGB"}[channels])
    expected = np.asarray(pil.resize((298, 224), filters[mode])).reshape(224, 298, channels)
    ours = resize_uint8(image, 224, 298, mode)
    assert ours.shape == (224, 298, channels) and ours.dtype == np.uint8
    apart = levels_apart(ours, expected)
    assert apart.max() <= 1 and (apart > 0).mean() < 0.02  # fixed-point rounding, the same filter


@pytest.mark.parametrize(("source", "target"), [((480, 640), (97, 33)), ((31, 47), (224, 224)),
                                                 ((300, 200), (300, 201)), ((900, 340), (690, 316))])
def test_any_resize_is_pillows_within_a_level_almost_everywhere(source: tuple[int, int],
                                                                target: tuple[int, int]) -> None:
    # Mild and enlarging resizes of noisy content: the two kernels clip and round their passes differently,
    # which shows where bicubic overshoots (up to ~10 levels at a few pixels in a thousand).
    image = photo(*source)
    expected = np.asarray(Image.fromarray(image).resize(target[::-1], Image.Resampling.BICUBIC))
    apart = levels_apart(resize_uint8(image, *target, "bicubic"), expected)
    assert (apart > 1).mean() < 0.01 and apart.max() <= 16


@pytest.mark.parametrize(("input_format", "output_format"), [(ChannelDimension.FIRST, None),
                                                             (ChannelDimension.LAST, None),
                                                             (ChannelDimension.FIRST, ChannelDimension.LAST),
                                                             (ChannelDimension.LAST, ChannelDimension.FIRST),
                                                             (None, None)])
@pytest.mark.parametrize("channels", [1, 3])
def test_it_is_torchs_antialiased_uint8_interpolate_in_the_layout_pillows_resize_gives(
    input_format: Any, output_format: Any, channels: int,
) -> None:
    hwc = photo(64, 48, channels=channels)
    image = np.moveaxis(hwc, -1, 0) if input_format == ChannelDimension.FIRST else hwc
    kwargs = {"resample": PILImageResampling.BICUBIC, "data_format": output_format,
              "input_data_format": input_format}
    ours = image_resize._resize(image, (20, 30), **kwargs)
    theirs = pillow_resize(image, (20, 30), **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == np.uint8
    # What HF's torchvision backend runs on CPU for a uint8 image (torchvision's resize calls it).
    nchw = torch.from_numpy(np.ascontiguousarray(np.moveaxis(hwc, -1, 0)))[None]
    expected = F.interpolate(nchw, size=(20, 30), mode="bicubic", antialias=True)[0].numpy()
    first = (output_format or input_format or ChannelDimension.LAST) == ChannelDimension.FIRST
    assert np.array_equal(ours if first else np.moveaxis(ours, -1, 0), expected)


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_every_pil_processor_resizes_with_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    images = [Image.fromarray(photo(900, 1300, seed=1)), Image.fromarray(photo(333, 120, seed=2))]
    use_torch_resize(False)
    pillow = PROCESSORS[name]()(images=images, return_tensors="pt")
    use_torch_resize(True)
    calls: list[tuple[int, int]] = []

    def counting(image: np.ndarray, height: int, width: int, mode: str) -> np.ndarray:
        calls.append((height, width))
        return resize_uint8(image, height, width, mode)

    monkeypatch.setattr(image_resize, "resize_uint8", counting)
    torch_out = PROCESSORS[name]()(images=images, return_tensors="pt")
    assert calls, f"{name}: the processor never reached torch's kernel"
    assert set(torch_out.keys()) == set(pillow.keys())
    for key in pillow:
        assert torch_out[key].shape == pillow[key].shape, key
        if key != "pixel_values":
            assert torch.equal(torch_out[key], pillow[key]), key  # grids, patch counts: the processor's own
    pixels, reference = torch_out["pixel_values"], pillow["pixel_values"]
    level = 1 / 255 / min(PROCESSORS[name]().image_std)  # type: ignore[attr-defined]  # one uint8 level after rescale and normalise
    assert ((pixels - reference).abs() > level + 1e-5).float().mean().item() < 0.01


@pytest.mark.parametrize(("image", "kwargs"), [
    (photo(120, 90), {"resample": PILImageResampling.NEAREST}),
    (photo(120, 90), {"resample": PILImageResampling.LANCZOS}),
    (photo(120, 90), {"resample": PILImageResampling.BICUBIC, "reducing_gap": 2}),
    (photo(120, 90).astype(np.float32) / 255, {"resample": PILImageResampling.BICUBIC}),
    (photo(120, 90, channels=4), {"resample": PILImageResampling.BICUBIC}),  # Pillow premultiplies alpha
    (photo(120, 90, channels=2), {"resample": PILImageResampling.BILINEAR}),
])
def test_what_the_kernel_does_not_cover_stays_with_pillow(image: np.ndarray, kwargs: dict[str, Any]) -> None:
    expected = pillow_resize(image, (50, 40), input_data_format=ChannelDimension.LAST, **kwargs)
    result = image_resize._resize(image, (50, 40), input_data_format=ChannelDimension.LAST, **kwargs)
    assert np.array_equal(result, expected)


def test_loader_installs_it_by_default_and_pillow_on_request(tiny_llava_path: Path) -> None:
    image = Image.fromarray(photo(600, 800))
    pillow = load_model(str(tiny_llava_path), weights=False, torch_resize=False)
    assert not torch_resize_in_use()
    by_pillow = pillow.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    expected = CLIPImageProcessorPil(**pillow.processor.image_processor.to_dict())
    assert torch.equal(by_pillow, expected(images=[image], return_tensors="pt")["pixel_values"])
    loaded = load_model(str(tiny_llava_path), weights=False)
    assert torch_resize_in_use()
    by_torch = loaded.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert by_torch.shape == by_pillow.shape and not torch.equal(by_torch, by_pillow)
