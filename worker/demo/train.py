"""Train the bundled demo model: a small LLaVA (CLIP tower + Llama decoder, transformers classes, a byte-level
BPE tokenizer trained with `tokenizers`) on the synthetic questions of worker/demo/shapes.py, on CPU.

    python -m worker.demo.train OUT_DIR [--steps 1800] [--minutes 28] [--seed 0]

Reproducible from the seed on a given machine: the data stream, the initial weights, the order and the
learning-rate schedule (over --steps) are all seeded or fixed; --minutes only stops a slow machine early.
bf16 autocast is used where the CPU has AMX (`lscpu`: amx_tile), fp32 elsewhere. Prints the loss
and, every --eval-every steps, exact-match accuracy by question kind on held-out samples (another seed) with
greedy HF `generate`. Saves the checkpoint with the best held-out accuracy in HF format.
"""

from __future__ import annotations

import argparse
import math
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from worker.demo.shapes import IMAGE_SIZE, KINDS, Sample, sample, samples
from worker.model_loader import LoadedModel, load_model
from worker.tiny_model import TinySpec, build_tiny_llava

# 64 px images in 8 px patches: 64 image tokens. ~6M parameters, a few MB in fp32.
DEMO_SPEC = TinySpec(image_size=IMAGE_SIZE, patch_size=8, vision_hidden=128, vision_layers=4, text_hidden=256,
                     text_layers=4, text_heads=8, text_kv_heads=4, max_positions=256, vocab_size=1200,
                     text_init_range=0.02, vision_init_range=0.02)
HELD_OUT_SEED = 1_000_003  # held-out questions never share the training stream's seed


def has_amx() -> bool:
    try:
        return "amx_tile" in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def batch_inputs(loaded: LoadedModel, batch: list[Sample]) -> dict[str, torch.Tensor]:
    """Prompt + answer + EOS per sample, right-padded; labels only on the answer and its EOS."""
    processor, tokenizer = loaded.processor, loaded.tokenizer
    prompts = [processor.apply_chat_template(messages(s.question), add_generation_prompt=True, tokenize=False)
               for s in batch]
    encoded = processor(text=prompts, images=[s.image for s in batch], return_tensors="pt", padding=True,
                        padding_side="right")
    rows, labels = [], []
    for i, s in enumerate(batch):
        prompt = encoded["input_ids"][i][encoded["attention_mask"][i].bool()].tolist()
        answer = tokenizer(s.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
        "pixel_values": encoded["pixel_values"],
    }


@torch.inference_mode()
def answer(loaded: LoadedModel, batch: list[Sample], max_new_tokens: int = 6) -> list[str]:
    processor, tokenizer = loaded.processor, loaded.tokenizer
    prompts = [processor.apply_chat_template(messages(s.question), add_generation_prompt=True, tokenize=False)
               for s in batch]
    inputs = processor(text=prompts, images=[s.image for s in batch], return_tensors="pt", padding=True,
                       padding_side="left")
    out = loaded.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=loaded.eos_token_ids, pad_token_id=tokenizer.pad_token_id)
    width = inputs["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def evaluate(loaded: LoadedModel, held_out: list[Sample], batch_size: int = 64) -> dict[str, float]:
    loaded.model.eval()
    right: dict[str, list[bool]] = {k: [] for k in KINDS}
    for i in range(0, len(held_out), batch_size):
        chunk = held_out[i:i + batch_size]
        for s, got in zip(chunk, answer(loaded, chunk), strict=True):
            right[s.kind].append(got == s.answer)
    loaded.model.train()
    scores = {k: sum(v) / len(v) for k, v in right.items() if v}
    scores["all"] = sum(sum(v) for v in right.values()) / len(held_out)
    return scores


def train(out_dir: Path, steps: int, minutes: float, seed: int, batch_size: int, lr: float, eval_every: int,
          n_eval: int) -> dict[str, float]:
    torch.manual_seed(seed)
    random.seed(seed)
    build_tiny_llava(out_dir, seed=seed, spec=DEMO_SPEC)
    loaded = load_model(str(out_dir))
    model = loaded.model
    model.train()
    held_out = samples(n_eval, HELD_OUT_SEED)
    stream = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=has_amx())
    deadline = time.monotonic() + minutes * 60
    warmup = min(200, steps // 10)
    best: dict[str, float] = {"all": -1.0}
    step, losses = 0, []
    started = time.monotonic()
    while step < steps and time.monotonic() < deadline:
        for group in optimizer.param_groups:
            cosine = 0.5 * (1 + math.cos(math.pi * step / steps))
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup)) * (0.05 + 0.95 * cosine)
        batch = batch_inputs(loaded, [sample(stream) for _ in range(batch_size)])
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {sum(losses[-50:]) / 50:.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"{(time.monotonic() - started) / step:.2f}s/step", flush=True)
        if step % eval_every == 0 or step == steps or time.monotonic() >= deadline:
            scores = evaluate(loaded, held_out)
            print(f"step {step} held-out exact match " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()),
                  flush=True)
            if scores["all"] > best["all"]:
                best = {**scores, "step": step}
                model.save_pretrained(out_dir, safe_serialization=True)
    print(f"best: {best}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--minutes", type=float, default=28.0, help="stop early past this (slow machines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-samples", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train(args.out_dir, args.steps, args.minutes, args.seed, args.batch_size, args.lr, args.eval_every,
          args.eval_samples)


if __name__ == "__main__":
    main()
