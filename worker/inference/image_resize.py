"""How HF's PIL-backed image processors resize: with Pillow, or with torch's antialiased uint8 resize.

Preparing a job with a photo is mostly resizing it: with Pillow, shrinking a camera photo to a tower's size is
most of the HF processor's time. transformers has two backends for each image processor; its default, the
torchvision one, resizes uint8 images on CPU with torch's antialiased bicubic/bilinear kernel
(`F.interpolate(..., antialias=True)`, vectorised and multi-threaded, a fraction of Pillow's time), and is what
an install with torchvision (and vLLM) runs. torchvision cannot be installed here, so the processors load with the
Pillow backend; `use_torch_resize` swaps the one function that backend resizes with (`np_resize` in
transformers.image_processing_backends) for the same torch kernel. Everything else (the processor's choice of
size, crop, rescale, normalise) stays the processor's own. The kernel's filters are Pillow's (bicubic a=-0.5,
the same support) but it rounds its passes differently: a photo shrunk to a tower's size is Pillow's exactly at
98% or more of its pixels and within one level at the rest; mild resizes of noisy content differ more often,
all but ~1% of pixels by at most one level.

The swap is process-wide, like the module global it replaces; `use_torch_resize(False)` restores Pillow. Inputs
the kernel does not cover (other filters, float images, alpha channels, `reducing_gap`, a PIL result) go to
Pillow as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

_MODES = {2: "bilinear", 3: "bicubic"}  # PILImageResampling.BILINEAR, .BICUBIC


def use_torch_resize(enabled: bool) -> None:
    """Resize in HF's PIL-backed image processors with torch's kernel (True) or with Pillow (False)."""
    from transformers import image_processing_backends, image_transforms

    image_processing_backends.np_resize = _resize if enabled else image_transforms.resize


def torch_resize_in_use() -> bool:
    from transformers import image_processing_backends

    return image_processing_backends.np_resize is _resize


def resize_uint8(image: np.ndarray, height: int, width: int, mode: str) -> np.ndarray:
    """Resize an HWC uint8 array with torch's antialiased kernel; returns a new HWC uint8 array."""
    # An HWC array seen as NCHW is channels-last, the layout the vectorised uint8 kernel reads without a copy.
    batch = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).unsqueeze(0)
    out = F.interpolate(batch, size=(height, width), mode=mode, antialias=True)
    return out[0].permute(1, 2, 0).contiguous().numpy()


def _resize(image: Any, size: tuple[int, int], resample: Any = None, reducing_gap: int | None = None,
            data_format: Any = None, return_numpy: bool = True, input_data_format: Any = None) -> Any:
    """`transformers.image_transforms.resize`, through torch's kernel for the inputs it covers."""
    from transformers import image_transforms
    from transformers.image_utils import ChannelDimension, infer_channel_dimension_format

    resample = 2 if resample is None else resample  # transformers' default is BILINEAR
    eligible = (
        isinstance(resample, int) and isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
        and resample in _MODES and reducing_gap is None and return_numpy and len(size) == 2
        and min(size) > 0
    )
    if eligible:
        if input_data_format is None:
            input_data_format = infer_channel_dimension_format(image)
        channels_first = ChannelDimension(input_data_format) == ChannelDimension.FIRST
        hwc = np.moveaxis(image, 0, -1) if channels_first else image
        eligible = hwc.shape[-1] in (1, 3)  # Pillow resizes LA and RGBA premultiplied by their alpha
    if eligible:
        resized = resize_uint8(hwc, int(size[0]), int(size[1]), _MODES[int(resample)])
        out_first = channels_first if data_format is None else ChannelDimension(data_format) == ChannelDimension.FIRST
        return np.moveaxis(resized, -1, 0) if out_first else resized
    return image_transforms.resize(image, size, resample=resample, reducing_gap=reducing_gap,
                                   data_format=data_format, return_numpy=return_numpy,
                                   input_data_format=input_data_format)
