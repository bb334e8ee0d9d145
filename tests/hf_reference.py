"""HF `generate` on one request alone: the reference every vlmq output must match token for token."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from worker.inference.model_loader import LoadedModel


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


# Two logits closer than this are a tie that float rounding (a different kernel, batch shape or summation order)
# may break either way; random tiny checkpoints hit a few such steps per thousand tokens.
NEAR_TIE = 1e-4


def hf_greedy_with_margins(
    loaded: LoadedModel, messages: list[dict[str, Any]], images: list[Image.Image], max_tokens: int
) -> tuple[list[int], list[tuple[int, float]]]:
    """Greedy tokens (cut after EOS) and, per step, (runner-up token, top-1 minus top-2 logit)."""
    processor = loaded.processor
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(
            **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=loaded.eos_token_ids,
            pad_token_id=loaded.tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True,
        )
    new = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    margins = []
    for scores in out.scores:
        top = torch.topk(scores[0].float(), 2)
        margins.append((int(top.indices[1]), float(top.values[0] - top.values[1])))
    for k, tok in enumerate(new):
        if tok in loaded.eos_token_ids:
            new = new[: k + 1]
            break
    return new, margins[: len(new)]


def assert_greedy_matches(got: list[int], expected: list[int], margins: list[tuple[int, float]], what: str) -> bool:
    """Token-identical, except that at a near-tie step the runner-up may win (and the sequences part there).

    Returns True when the sequences were identical, False when they parted at a near-tie."""
    for step, (g, e) in enumerate(zip(got, expected, strict=False)):
        if g == e:
            continue
        runner_up, margin = margins[step]
        assert g == runner_up and margin < NEAR_TIE, (
            f"{what}: step {step} gave {g}, HF gave {e} (runner-up {runner_up}, margin {margin:.2e})"
        )
        return False
    assert got == expected, f"{what}: {got} != {expected}"
    return True


def hf_reference_answer(
    loaded: LoadedModel, messages: list[dict[str, Any]], images: list[Image.Image], max_tokens: int
) -> tuple[str, int, int, bool]:
    """(text, completion_tokens, prompt_tokens, near_tie): near_tie says some greedy step of HF itself was a
    near-tie, where another numerically correct run may pick the runner-up."""
    tokens, margins = hf_greedy_with_margins(loaded, messages, images, max_tokens)
    prompt = loaded.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_prompt = loaded.processor(text=prompt, images=images or None, return_tensors="pt")["input_ids"].shape[1]
    text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
    return text, len(tokens), int(n_prompt), any(m < NEAR_TIE for _, m in margins)
