"""Build tiny random-weight VLM checkpoints offline (LLaVA, Qwen2-VL, InternVL), for tests and local smoke runs.

Each checkpoint is a real transformers model + processor directory (`LlavaForConditionalGeneration`,
`Qwen2VLForConditionalGeneration`, `InternVLForConditionalGeneration`), loadable with the same
`AutoModelForImageTextToText` / `AutoProcessor` calls as a hub model (see `worker.inference.model_loader`), so
everything downstream of the loader is exercised exactly as in production. Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

IMAGE_TOKEN = "<image>"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")


def _chat_template(image_markup: str) -> str:
    """Chat template rendering each {"type": "image"} part as `image_markup`.

    The processor later expands the image token inside the markup to the image's number of embeddings.
    `content` may be a plain string (text-only turns), as in HF chat format.
    """
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}" + image_markup + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ eos_token }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
    )


# LLaVA: the bare image token, which LlavaProcessor expands to the number of patch embeddings.
CHAT_TEMPLATE = _chat_template(IMAGE_TOKEN)

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

# A small vocabulary, so BPE merges real words and the tiny model's prompts tokenize like text.
_WORD_TEXT = (
    "the a an this that one two three red green blue yellow black white small large round square bright "
    "dark cat dog bird car tree house road river sky cloud sun moon street window door table chair cup "
    "book person child man woman boat train plane flower grass field city picture image photo scene color "
    "shape left right top bottom middle near far above below behind front is are was has have shows "
    "contains looks sits stands runs flies and or with on in at of to from under over next there here "
    "what which where how many describe tell me about answer question yes no some every each very quite "
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny checkpoint: builds in seconds, runs 20 requests in well under a second."""

    image_size: int = 32
    patch_size: int = 8
    vision_hidden: int = 64
    vision_layers: int = 2
    text_hidden: int = 96
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    max_positions: int = 512
    vocab_size: int = 1200
    # Random LMs at the usual 0.02 have nearly flat logits, so greedy picks flip on 1e-6 float noise (padding,
    # batch shape). A wider init separates the top-1 logit while keeping outputs varied across prompts.
    text_init_range: float = 0.2
    vision_init_range: float = 0.2
    # The image processor's normalisation; None: the tower's usual (CLIP's or SigLIP's) mean and std.
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None


def _corpus(rng: random.Random, n_lines: int = 3000) -> list[str]:
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 999)}"
        lines.append(sentence)
    return lines


def _build_tokenizer(
    spec: TinySpec,
    seed: int,
    mm_tokens: dict[str, str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
    corpus: list[str] | None = None,
) -> Any:  # a PreTrainedTokenizerFast, whose token lookups typing leaves as int | list[int]
    """Byte-level BPE trained on `corpus` (default: a seeded corpus of common words); `mm_tokens` maps tokenizer
    attribute names to special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    mm_tokens = {"image_token": IMAGE_TOKEN} if mm_tokens is None else mm_tokens
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, *mm_tokens.values(), *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or _corpus(random.Random(seed)), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        extra_special_tokens=dict(mm_tokens),
        chat_template=chat_template,
        padding_side="left",
        model_max_length=spec.max_positions,
    )


def _text_config_kwargs(spec: TinySpec, tokenizer: Any) -> dict[str, Any]:
    """Decoder sizes and special ids shared by every family's text config."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.text_hidden,
        "intermediate_size": spec.text_hidden * 2,
        "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads,
        "num_key_value_heads": spec.text_kv_heads,
        "max_position_embeddings": spec.max_positions,
        "initializer_range": spec.text_init_range,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }


def _set_generation_ids(model: Any, tokenizer: Any) -> None:
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id


def _image_only_processor(base: type[Any], **kwargs: Any) -> Any:
    """An instance of processor class `base` without its video slot, saved under `base`'s own name."""
    from worker.inference.model_loader import image_only_processor_class

    return image_only_processor_class(base, name=base.__name__)(**kwargs)


def build_tiny_llava(out_dir: Path, *, seed: int = 0, vision: str = "clip", spec: TinySpec | None = None,
                     corpus: list[str] | None = None) -> Path:
    """Write a tiny random LLaVA (model, tokenizer, image processor, processor) to `out_dir`; return it.

    Deterministic given `seed`: the same seed gives byte-identical weights and the same tokenizer.
    `vision` picks the tower: "clip" (a CLS token, dropped by the "default" feature selection, as in
    LLaVA-1.5) or "siglip" (no CLS, "full" selection), so both placeholder-count conventions can be exercised.
    `corpus` is the text the tokenizer's BPE merges are learnt from (a trained model's own vocabulary).
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    if vision not in ("clip", "siglip"):
        raise ValueError(f"unsupported vision tower {vision!r}; choose 'clip' or 'siglip'")
    spec = spec or TinySpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(spec, seed, corpus=corpus)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    n_patches = (spec.image_size // spec.patch_size) ** 2

    tower: dict[str, Any] = {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_hidden * 2,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": 4,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
    }
    normalisation: dict[str, Any] = {name: list(value) for name, value in (("image_mean", spec.image_mean),
                                                           ("image_std", spec.image_std)) if value is not None}
    vision_config: CLIPVisionConfig | SiglipVisionConfig
    image_processor: CLIPImageProcessorPil | SiglipImageProcessorPil
    select_strategy: Literal["default", "full"]
    if vision == "clip":
        vision_config = CLIPVisionConfig(
            **tower, projection_dim=spec.vision_hidden, initializer_range=spec.vision_init_range
        )
        select_strategy, extra_tokens = "default", 1
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": spec.image_size},
            crop_size={"height": spec.image_size, "width": spec.image_size},
            **normalisation,
        )
    else:
        vision_config = SiglipVisionConfig(**tower)
        select_strategy, extra_tokens = "full", 0
        image_processor = SiglipImageProcessorPil(size={"height": spec.image_size, "width": spec.image_size},
                                                  **normalisation)
    text_config = LlamaConfig(**_text_config_kwargs(spec, tokenizer))
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=n_patches,
        vision_feature_select_strategy=select_strategy,
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    _set_generation_ids(model, tokenizer)

    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy=select_strategy,
        # CLIP prepends a CLS embedding that "default" selection then drops again; SigLIP has none.
        num_additional_image_tokens=extra_tokens,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


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
    parser = argparse.ArgumentParser(prog="python -m worker.inference.tiny_model", description=__doc__.splitlines()[0])
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
