"""Build a tiny random-weight LLaVA checkpoint offline, for `vlmq make-tiny-model`, smoke runs and bench/.

The checkpoint is a real transformers model + processor directory (`LlavaForConditionalGeneration`), loadable
with the same `AutoModelForImageTextToText` / `AutoProcessor` calls as a hub model (see
`worker.inference.model_loader`), so everything downstream of the loader is exercised exactly as in production.
Nothing here touches the network. The other families' tiny checkpoints (Qwen2-VL, InternVL) are test fixtures:
tests/tiny_families.py builds them from the tokenizer and config helpers here.
"""

from __future__ import annotations

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
