"""HF `generate` on one request alone: the reference every vlmq output must match token for token."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from worker.model_loader import LoadedModel


def hf_generate_alone(
    loaded: LoadedModel, messages: list[dict[str, Any]], images: list[Image.Image], max_tokens: int
) -> tuple[str, int, int]:
    """Greedy; returns (text, completion_tokens, prompt_tokens), cut after the first EOS."""
    processor = loaded.processor
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(
            **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=loaded.eos_token_ids,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
    prompt_len = inputs["input_ids"].shape[1]
    new = out[0, prompt_len:].tolist()
    for k, tok in enumerate(new):
        if tok in loaded.eos_token_ids:
            new = new[: k + 1]
            break
    text = loaded.tokenizer.decode(new, skip_special_tokens=True)
    return text, len(new), prompt_len


def hf_messages(openai_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat content parts -> HF chat template parts (images become {"type": "image"})."""
    out = []
    for m in openai_messages:
        content = m["content"]
        if isinstance(content, str):
            parts: list[dict[str, Any]] = [{"type": "text", "text": content}]
        else:
            parts = [{"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]}
                     for p in content]
        out.append({"role": m["role"], "content": parts})
    return out
