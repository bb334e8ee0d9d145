"""Tiny random checkpoints of families the engine does not run, for the HF fallback's tests (offline)."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.inference.tiny_model import (
    TinySpec,
    _build_tokenizer,
    _chat_template,
    _set_generation_ids,
    _text_config_kwargs,
)


def build_tiny_gemma3(out_dir: Path, *, seed: int = 0) -> Path:
    """Gemma3: a SigLIP tower pooled to 4 tokens an image, a decoder whose generate takes no inputs_embeds and
    whose image tokens attend both ways (token_type_ids), sliding and full attention layers alternating."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    spec = TinySpec()
    tokens = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    template = _chat_template("<start_of_image>")
    tokenizer = _build_tokenizer(spec, seed, tokens, template)
    head_dim = spec.text_hidden // spec.text_heads
    text_config = Gemma3TextConfig(**_text_config_kwargs(spec, tokenizer), head_dim=head_dim,
                                   query_pre_attn_scalar=head_dim, sliding_window=512,
                                   layer_types=["sliding_attention", "full_attention"])
    vision_config = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=32, patch_size=8)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    config = Gemma3Config(text_config=text_config, vision_config=vision_config, mm_tokens_per_image=4,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    _set_generation_ids(model, tokenizer)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, image_seq_length=4, chat_template=template)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_idefics2(out_dir: Path, *, seed: int = 0) -> Path:
    """Idefics2: a perceiver resampler to 4 latents an image, pixel_values laid out [1, n_images, ...] (so a
    request of several images cannot be split per image), and a processor that takes only PIL images."""
    from transformers import (
        Idefics2Config,
        Idefics2ForConditionalGeneration,
        Idefics2ImageProcessorPil,
        Idefics2Processor,
        MistralConfig,
    )
    from transformers.models.idefics2.configuration_idefics2 import Idefics2PerceiverConfig, Idefics2VisionConfig

    from worker.inference.tiny_model import CHAT_TEMPLATE

    spec = TinySpec()
    tokens = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
              "image_boundary_token": "<fake_token_around_image>", "end_of_utterance_token": "<end_of_utterance>"}
    tokenizer = _build_tokenizer(spec, seed, tokens, CHAT_TEMPLATE)
    vision = Idefics2VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8, initializer_range=0.2)
    perceiver = Idefics2PerceiverConfig(hidden_size=spec.text_hidden, resampler_n_latents=4, resampler_depth=1,
                                        resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=1)
    config = Idefics2Config(vision_config=vision, perceiver_config=perceiver,
                            text_config=MistralConfig(**_text_config_kwargs(spec, tokenizer), sliding_window=None),
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics2ForConditionalGeneration(config)
    _set_generation_ids(model, tokenizer)
    image_processor = Idefics2ImageProcessorPil(size={"shortest_edge": 32, "longest_edge": 32},
                                                do_image_splitting=False)
    processor = Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir
