"""Build a tiny random-weight LLaVA checkpoint offline, for tests and local smoke runs.

The checkpoint is a real `LlavaForConditionalGeneration` + `LlavaProcessor` directory, loadable with the
same `AutoModelForImageTextToText` / `AutoProcessor` calls as a hub model, so everything downstream of the
loader is exercised exactly as in production. Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# Renders {"type": "image"} parts as the bare image token: LlavaProcessor later expands each one to the
# number of patch embeddings. `content` may be a plain string (text-only turns), as in HF chat format.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

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


def _build_tokenizer(spec: TinySpec, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, IMAGE_TOKEN, *ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=spec.max_positions,
    )


def build_tiny_llava(out_dir: Path, *, seed: int = 0, vision: str = "clip") -> Path:
    """Write a tiny random LLaVA (model, tokenizer, image processor, processor) to `out_dir`; return it.

    Deterministic given `seed`: the same seed gives byte-identical weights and the same tokenizer.
    `vision` picks the tower: "clip" (a CLS token, dropped by the "default" feature selection, as in
    LLaVA-1.5) or "siglip" (no CLS, "full" selection), so both placeholder-count conventions can be exercised.
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
    spec = TinySpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(spec, seed)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    n_patches = (spec.image_size // spec.patch_size) ** 2

    tower = {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": spec.vision_hidden * 2,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": 4,
        "image_size": spec.image_size,
        "patch_size": spec.patch_size,
    }
    if vision == "clip":
        vision_config = CLIPVisionConfig(
            **tower, projection_dim=spec.vision_hidden, initializer_range=spec.vision_init_range
        )
        select_strategy, extra_tokens = "default", 1
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": spec.image_size},
            crop_size={"height": spec.image_size, "width": spec.image_size},
        )
    else:
        vision_config = SiglipVisionConfig(**tower)
        select_strategy, extra_tokens = "full", 0
        image_processor = SiglipImageProcessorPil(size={"height": spec.image_size, "width": spec.image_size})
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_hidden * 2,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.text_init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
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
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision", choices=("clip", "siglip"), default="clip")
    args = parser.parse_args(argv)
    print(build_tiny_llava(args.out_dir, seed=args.seed, vision=args.vision))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
