"""How the demo model is asked and scored: the user's turn with the question and the image in either order,
greedy answers with HF `generate`, exact match by kind of question. Shared by training (worker/demo/train.py),
the evaluation script (worker/demo/evaluate.py) and the tests.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from worker.demo.shapes import KINDS, Sample
from worker.inference.model_loader import LoadedModel

HELD_OUT_SEED = 1_000_003  # the held-out set: never trained on, never used to pick a checkpoint
VALIDATION_SEED = 2_000_003  # picks the checkpoint to keep
N_HELD_OUT = 1000
MAX_ANSWER_TOKENS = 6  # the longest answer is two words and EOS
ORDERS = {"text first": False, "image first": True}  # the user turn's layouts, by whether the image leads


def messages(question: str, image_first: bool = False) -> list[dict[str, Any]]:
    """The user's turn: the question and the image, in either order.

    The model learns on the question before the image, so that in the decoder every image token can already see
    what is asked about and mark itself (one hop less for the answer to find the shape the question names); the
    demo's chat template renders either order that way (worker/demo/chat_template.py).
    """
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}, {"type": "image"}]
    return [{"role": "user", "content": parts[::-1] if image_first else parts}]


@torch.inference_mode()
def answer(loaded: LoadedModel, batch: list[Sample], image_first: bool = False,
           max_new_tokens: int = MAX_ANSWER_TOKENS) -> list[str]:
    processor, tokenizer = loaded.processor, loaded.tokenizer
    prompts = [processor.apply_chat_template(messages(s.question, image_first), add_generation_prompt=True,
                                             tokenize=False) for s in batch]
    inputs = processor(text=prompts, images=[s.image for s in batch], return_tensors="pt", padding=True,
                       padding_side="left")
    out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=loaded.eos_token_ids, pad_token_id=tokenizer.pad_token_id)
    width = inputs["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def hf_answers(loaded: LoadedModel, batch: list[Sample], image_first: bool = False, batch_size: int = 64) -> list[str]:
    return [a for i in range(0, len(batch), batch_size) for a in answer(loaded, batch[i:i + batch_size], image_first)]


def exact_match(batch: list[Sample], got: list[str]) -> dict[str, float]:
    """Exact match by kind of question, and over all of them."""
    right = Counter(s.kind for s, a in zip(batch, got, strict=True) if a == s.answer)
    total = Counter(s.kind for s in batch)
    return {**{k: right[k] / total[k] for k in KINDS if total[k]}, "all": sum(right.values()) / len(batch)}


def evaluate(loaded: LoadedModel, held_out: list[Sample]) -> dict[str, dict[str, float]]:
    """Exact match with the question before the image ("text first") and after it ("image first")."""
    loaded.model.eval()
    scores = {order: exact_match(held_out, hf_answers(loaded, held_out, image_first))
              for order, image_first in ORDERS.items()}
    loaded.model.train()
    return scores


def report(label: str, scores: dict[str, dict[str, float]]) -> str:
    return f"{label}: " + "; ".join(f"{order} " + ", ".join(f"{k} {v:.3f}" for k, v in by_kind.items())
                                    for order, by_kind in scores.items())
