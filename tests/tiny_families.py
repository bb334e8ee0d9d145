"""Tiny random-weight Qwen2-VL, Qwen2.5-VL and InternVL checkpoints, built offline for the engine's family
tests and bench/ (the product ships only the LLaVA one: worker/inference/tiny_model.py).

Each is a real transformers model + processor directory (`Qwen2VLForConditionalGeneration`,
`InternVLForConditionalGeneration`), loadable as a hub model is; nothing here touches the network.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from worker.inference.tiny_model import (
    TinySpec,
    _build_tokenizer,
    _chat_template,
    _set_generation_ids,
    _text_config_kwargs,
    build_tiny_llava,
)

# Qwen2-VL's own markup: Qwen2VLProcessor expands <|image_pad|> to grid_h * grid_w / merge**2 tokens.
QWEN2_VL_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
}
QWEN2_VL_CHAT_TEMPLATE = _chat_template("<|vision_start|><|image_pad|><|vision_end|>")

# InternVL names its tokens through these tokenizer attributes; InternVLProcessor expands each <IMG_CONTEXT> to
# <img> + <IMG_CONTEXT> * (image_seq_length * tiles) + </img>.
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
INTERNVL_CHAT_TEMPLATE = _chat_template(INTERNVL_TOKENS["context_image_token"])

def _image_only_processor(base: type[Any], **kwargs: Any) -> Any:
    """An instance of processor class `base` without its video slot, saved under `base`'s own name."""
    from worker.inference.model_loader import image_only_processor_class

    return image_only_processor_class(base, name=base.__name__)(**kwargs)


def build_tiny_qwen2_vl(out_dir: Path, *, seed: int = 0, version: str = "2") -> Path:
    """Write a tiny random Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5": the same decoder and positions, a
    tower with windowed attention and a gated MLP) (model, tokenizer, image processor, image-only processor).

    Images are resized to sides that are multiples of patch * merge = 16 px, with 32*32 to 64*64 pixels in all,
    so each becomes a (1, h, w) grid of 16..64 patches and 4..16 placeholder tokens, by aspect ratio. The text model
    uses M-RoPE with `mrope_section` [4, 4, 4] (t, h, w) over head_dim 24, and a small rope_theta so that all
    three sections turn noticeably over a short prompt: a wrong position row changes the logits.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
        Qwen2VLTextConfig,
        Qwen2VLVisionConfig,
    )
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig

    if version not in ("2", "2.5"):
        raise ValueError(f"unsupported Qwen-VL version {version!r}; choose '2' or '2.5'")
    spec = TinySpec()
    patch, merge, temporal = 8, 2, 2
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(spec, seed, QWEN2_VL_TOKENS, QWEN2_VL_CHAT_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in QWEN2_VL_TOKENS.items()}
    head_dim = spec.text_hidden // spec.text_heads
    section = head_dim // 2 // 3
    text_config = (Qwen2VLTextConfig if version == "2" else Qwen2_5_VLTextConfig)(
        **_text_config_kwargs(spec, tokenizer),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,
            "mrope_section": [head_dim // 2 - 2 * section, section, section],
        },
    )
    vision_config: Qwen2VLVisionConfig | Qwen2_5_VLVisionConfig
    if version == "2":
        vision_config = Qwen2VLVisionConfig(
            depth=spec.vision_layers,
            embed_dim=spec.vision_hidden,
            hidden_size=spec.text_hidden,  # the patch merger projects straight to the text width
            num_heads=4,
            mlp_ratio=2,
            patch_size=patch,
            spatial_merge_size=merge,
            temporal_patch_size=temporal,
            initializer_range=spec.vision_init_range,
        )
    else:
        vision_config = Qwen2_5_VLVisionConfig(
            depth=spec.vision_layers,
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_hidden * 2,
            out_hidden_size=spec.text_hidden,
            num_heads=4,
            patch_size=patch,
            spatial_merge_size=merge,
            temporal_patch_size=temporal,
            # Windows of 2x2 merged patches, the last block attending over the whole image, as 7B's do.
            window_size=2 * patch * merge,
            fullatt_block_indexes=[spec.vision_layers - 1],
            initializer_range=spec.vision_init_range,
        )
    config = (Qwen2VLConfig if version == "2" else Qwen2_5_VLConfig)(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = (Qwen2_5_VLForConditionalGeneration(config) if isinstance(config, Qwen2_5_VLConfig)
             else Qwen2VLForConditionalGeneration(config))
    _set_generation_ids(model, tokenizer)

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        min_pixels=(2 * patch * merge) ** 2,
        max_pixels=(4 * patch * merge) ** 2,
    )
    processor = _image_only_processor(
        Qwen2VLProcessor if version == "2" else Qwen2_5_VLProcessor, image_processor=image_processor,
        tokenizer=tokenizer, chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_internvl(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random InternVL (native transformers port, Qwen2 text model) to `out_dir`; return it.

    Tiles are 32x32 px with 8 px patches: 16 patch tokens, pixel-shuffled (downsample 0.5) to 4 placeholder
    tokens per tile, so image runs stay as short as the tiny LLaVA's and Qwen2-VL's. The image processor crops an
    image to at most 4 tiles by aspect ratio, plus a thumbnail tile when it crops, so images of different shapes
    take 1, 3, 4 or 5 tiles (4..20 tokens).
    """
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVisionConfig,
        Qwen2Config,
    )

    spec = TinySpec()
    patch, downsample = spec.patch_size, 0.5
    image_seq_length = int((spec.image_size // patch) ** 2 * downsample**2)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(spec, seed, INTERNVL_TOKENS, INTERNVL_CHAT_TEMPLATE)
    vision_config = InternVLVisionConfig(
        hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_hidden * 2,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=4,
        image_size=spec.image_size,
        patch_size=patch,
        initializer_range=spec.vision_init_range,
    )
    config = InternVLConfig(
        vision_config=vision_config,
        text_config=Qwen2Config(**_text_config_kwargs(spec, tokenizer)),
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        image_seq_length=image_seq_length,
        downsample_ratio=downsample,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    _set_generation_ids(model, tokenizer)

    image_processor = GotOcr2ImageProcessorPil(
        size={"height": spec.image_size, "width": spec.image_size},
        crop_to_patches=True,
        min_patches=1,
        max_patches=4,
    )
    processor = _image_only_processor(
        InternVLProcessor,
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=image_seq_length,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


FAMILIES = ("llava", "llava-siglip", "qwen2-vl", "qwen2.5-vl", "internvl")


def build_tiny(out_dir: Path, family: str = "llava", *, seed: int = 0) -> Path:
    """Build the tiny checkpoint of `family` (one of FAMILIES) in `out_dir`."""
    if family == "llava":
        return build_tiny_llava(out_dir, seed=seed)
    if family == "llava-siglip":
        return build_tiny_llava(out_dir, seed=seed, vision="siglip")
    if family == "qwen2-vl":
        return build_tiny_qwen2_vl(out_dir, seed=seed)
    if family == "qwen2.5-vl":
        return build_tiny_qwen2_vl(out_dir, seed=seed, version="2.5")
    if family == "internvl":
        return build_tiny_internvl(out_dir, seed=seed)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tiny_families", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILIES, default="llava")
    parser.add_argument("--vision", choices=("clip", "siglip"), default="clip", help="LLaVA tower (--family llava)")
    args = parser.parse_args(argv)
    family = "llava-siglip" if args.family == "llava" and args.vision == "siglip" else args.family
    print(build_tiny(args.out_dir, family, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
