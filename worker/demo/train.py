"""Train the bundled demo model: a small LLaVA (CLIP tower + Llama decoder, transformers classes, a byte-level
BPE tokenizer trained with `tokenizers` on the task's words) on the synthetic questions of
worker/demo/shapes.py, on CPU, from scratch.

    python -m worker.demo.train OUT_DIR [--steps 3000] [--minutes 27] [--seed 0]
    python -m worker.demo.train OUT_DIR --init-from worker/demo/model --image-first-share 0.5 --steps 1500 --lr 5e-4

The second fine-tunes a checkpoint with some questions' pictures placed before the text (the chat template
used in training keeps each question's order; the one written to OUT_DIR, worker/demo/chat_template.py, puts
text first for serving); validation and held-out scores are given for both orders.

Reproducible from the seed on a given machine: the data stream, the initial weights, the order and the
learning-rate schedule (over --steps) are all seeded or fixed; --minutes only stops a slow machine early.
bf16 autocast is used where the CPU has AMX (`lscpu`: amx_tile), fp32 elsewhere. Prints the losses and, every
--eval-every steps, exact-match accuracy by question kind on validation questions (their own seed) with greedy
HF `generate`, keeping the checkpoint that scores best there (HF format: safetensors, config, processor); at
the end that checkpoint is scored once on the 1,000 held-out questions (another seed).

Two things make a model this small learn to see in a short training (without them it stayed near chance):
the question comes before the image in the prompt, and a training-only probe asks every image token what is in
its grid cell (see CellProbe).
"""

from __future__ import annotations

import argparse
import math
import operator
import random
import shutil
import subprocess
import time
from functools import reduce
from pathlib import Path
from typing import Any

import torch

from worker.demo.chat_template import write_chat_template
from worker.demo.scoring import (
    HELD_OUT_SEED,
    MAX_ANSWER_TOKENS,
    N_HELD_OUT,
    ORDERS,
    VALIDATION_SEED,
    evaluate,
    messages,
    report,
)
from worker.demo.shapes import (
    CELL,
    COLOURS,
    GRID,
    IMAGE_SIZE,
    MAX_RADIUS,
    MIN_RADIUS,
    SHAPES,
    Sample,
    corpus,
    sample,
    samples,
)
from worker.inference.model_loader import LoadedModel, load_model
from worker.inference.tiny_model import CHAT_TEMPLATE, TinySpec, build_tiny_llava

# 96 px images in 24 px patches, one per grid cell: 16 image tokens. The white background is normalised to 0, so
# an empty cell's patch embedding is ~0 and its position embedding is what the tower sees of it: with CLIP's
# usual normalisation the background's embedding drowned the position embedding, and the image tokens were slow
# to tell left from right.
DEMO_SPEC = TinySpec(image_size=IMAGE_SIZE, patch_size=CELL, vision_hidden=128, vision_layers=3, text_hidden=256,
                     text_layers=4, text_heads=8, text_kv_heads=4, max_positions=256, vocab_size=400,
                     text_init_range=0.02, vision_init_range=0.02, image_mean=(1.0, 1.0, 1.0),
                     image_std=(0.5, 0.5, 0.5))
# Per cell: colour, shape and size (each with "empty"), then its row and column.
CELL_CLASSES = (len(COLOURS) + 1, len(SHAPES) + 1, MAX_RADIUS - MIN_RADIUS + 2, GRID, GRID)


def has_amx() -> bool:
    try:
        return "amx_tile" in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False


def image_first_flags(rng: random.Random, n: int, share: float) -> list[bool]:
    """Which of `n` training questions put their image before the text: each independently, with chance `share`."""
    return [rng.random() < share for _ in range(n)]


def batch_inputs(loaded: LoadedModel, batch: list[Sample], image_first: list[bool]) -> dict[str, torch.Tensor]:
    """Prompt + answer + EOS per sample, right-padded; labels only on the answer and its EOS."""
    processor, tokenizer = loaded.processor, loaded.tokenizer
    prompts = [processor.apply_chat_template(messages(s.question, first), add_generation_prompt=True, tokenize=False)
               for s, first in zip(batch, image_first, strict=True)]
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
        "cells": cell_labels(batch),
    }


def grid_position_embedding(model: Any) -> None:
    """Start the tower's position embeddings as 2-D sin/cos of each patch's row and column, at unit scale.

    Learnt from their usual small-scale start they hardly grew, and the image tokens were slow to tell left from
    right: the decoder cannot answer "left or right?" before the tower knows where each patch is. Patch i (after the
    class embedding, which keeps position 0) sits in row i // GRID and column i % GRID.
    """
    [table] = [m for name, m in model.model.vision_tower.named_modules() if name.endswith("position_embedding")]
    dim = table.weight.shape[1]
    quarter = dim // 4
    frequencies = 1.0 / (GRID ** (torch.arange(quarter) / quarter))
    cells = torch.arange(GRID * GRID)
    angles = [torch.outer((cells // GRID).float(), frequencies), torch.outer((cells % GRID).float(), frequencies)]
    grid = torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], dim=1)
    with torch.no_grad():
        table.weight.zero_()
        table.weight[1:, : grid.shape[1]] = grid


def cell_labels(batch: list[Sample]) -> torch.Tensor:
    """[batch, cells, 5]: per grid cell, the colour, shape and size class of its shape (0: the cell is empty),
    and the cell's row and column."""
    labels = torch.zeros(len(batch), GRID * GRID, len(CELL_CLASSES), dtype=torch.long)
    labels[:, :, 3] = torch.arange(GRID * GRID) // GRID
    labels[:, :, 4] = torch.arange(GRID * GRID) % GRID
    for b, s in enumerate(batch):
        for item in s.items:
            labels[b, item.cell, :3] = torch.tensor([list(COLOURS).index(item.colour) + 1,
                                                     SHAPES.index(item.shape) + 1, item.radius - MIN_RADIUS + 1])
    return labels


class CellProbe(torch.nn.Module):
    """Training-only heads that read each image token's cell (colour, shape, size; row, column) from the
    projected features.

    Trained from the LM loss alone, the tower and projector of a model this small collapsed to one constant
    embedding for every image (the LM then answered from the question's priors, at chance). Asking every image
    token to say what is in its cell gives the vision side a dense signal from the first step; the heads are
    not part of the saved checkpoint.
    """

    colour_ids: torch.Tensor  # buffers, registered in __init__
    shape_ids: torch.Tensor
    side_ids: torch.Tensor

    def __init__(self, hidden: int, word_ids: dict[str, list[int]], embeddings: torch.nn.Embedding) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(hidden, n) for n in CELL_CLASSES)
        # The words that name what a cell holds, as a question spells them (" red", " circle", " left"): a
        # shape's token is also scored against the decoder's own embedding table, so that it lies near those
        # words. A question word then finds its shape by a plain dot product, and the answer is a copy: trained
        # without this, the decoder learnt colours and shapes slowly and left/right (a column mapped to a word)
        # not at all in 1,250 steps.
        self.register_buffer("colour_ids", torch.tensor([-100, *word_ids["colour"]]), persistent=False)
        self.register_buffer("shape_ids", torch.tensor([-100, *word_ids["shape"]]), persistent=False)
        self.register_buffer("side_ids", torch.tensor([word_ids["side"][c * 2 // GRID] for c in range(GRID)]),
                             persistent=False)
        self.embeddings = embeddings

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy
        loss = reduce(operator.add, (ce(head(features).flatten(0, 1), labels[..., k].flatten())
                                     for k, head in enumerate(self.heads)))
        vocab_logits = (features @ self.embeddings.weight.T).flatten(0, 1)
        occupied = labels[..., 0].flatten() > 0
        sides = torch.where(occupied, self.side_ids[labels[..., 4].flatten()], -100)
        for targets in (self.colour_ids[labels[..., 0].flatten()], self.shape_ids[labels[..., 1].flatten()], sides):
            loss = loss + ce(vocab_logits, targets)
        return loss / (len(self.heads) + 3)


def question_word_ids(loaded: LoadedModel) -> dict[str, list[int]]:
    """The one token each colour, shape and side word is inside a question (" red", " circle", " left")."""
    ids = {}
    for name, words in (("colour", list(COLOURS)), ("shape", list(SHAPES)), ("side", ["left", "right"])):
        tokens = [loaded.tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in words]
        if any(len(t) != 1 for t in tokens):
            raise ValueError(f"the demo tokenizer splits one of {words}: {tokens}")
        ids[name] = [t[0] for t in tokens]
    return ids


def forward_loss(loaded: LoadedModel, probe: CellProbe, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """LM loss and cell-probe loss, with the image features computed once and shared by both."""
    model = loaded.model
    features = model.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    features = torch.stack(list(features)) if isinstance(features, (list, tuple)) else features
    embeds = model.get_input_embeddings()(batch["input_ids"])
    is_image = (batch["input_ids"] == loaded.image_token_id).unsqueeze(-1)
    embeds = embeds.masked_scatter(is_image, features.reshape(-1, features.shape[-1]).to(embeds.dtype))
    lm_loss = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    return lm_loss, probe(features, batch["cells"])


def load_for_training(model_dir: Path) -> LoadedModel:
    """The checkpoint with a template that keeps the parts of a turn in the order given: training and its
    scores are about the weights, in the layout each question asks for; the demo's own template, which puts
    text first whatever the order (worker/demo/chat_template.py), is what the service renders with."""
    loaded = load_model(str(model_dir))
    loaded.processor.chat_template = CHAT_TEMPLATE
    return loaded


def train(out_dir: Path, steps: int, minutes: float, seed: int, batch_size: int, lr: float, eval_every: int,
          n_eval: int, init_from: Path | None = None, image_first_share: float = 0.0) -> dict[str, dict[str, float]]:
    torch.manual_seed(seed)
    random.seed(seed)
    if init_from is None:
        build_tiny_llava(out_dir, seed=seed, spec=DEMO_SPEC, corpus=corpus())
    else:
        shutil.copytree(init_from, out_dir, dirs_exist_ok=True)
    write_chat_template(out_dir)
    loaded = load_for_training(out_dir)
    model = loaded.model
    # Its answers are a few words: a request that sets no max_tokens gets this many (worker/inference/model_loader.py).
    model.generation_config.max_new_tokens = MAX_ANSWER_TOKENS
    if init_from is None:
        grid_position_embedding(model)
    model.train()
    validation = samples(n_eval, VALIDATION_SEED)
    stream = random.Random(seed)
    # The orders come from a stream of their own, so that with no image-first share the questions and pictures
    # are those of the run before the share existed.
    order_stream = random.Random(f"order-{seed}")
    # The checkpoint kept is the one whose worse score, over the orders trained on, is best.
    trained_on = [order for order, image_first in ORDERS.items()
                  if (image_first_share if image_first else 1 - image_first_share) > 0]
    probe = CellProbe(model.config.text_config.hidden_size, question_word_ids(loaded), model.get_input_embeddings())
    optimizer = torch.optim.AdamW([*model.parameters(), *probe.heads.parameters()], lr=lr, weight_decay=0.01,
                                  betas=(0.9, 0.98))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=has_amx())
    deadline = time.monotonic() + minutes * 60
    warmup = min(200, steps // 10)
    best, best_step = -1.0, 0
    step, losses = 0, []
    started = time.monotonic()
    while step < steps and time.monotonic() < deadline:
        for group in optimizer.param_groups:
            cosine = 0.5 * (1 + math.cos(math.pi * step / steps))
            group["lr"] = lr * min(1.0, (step + 1) / max(1, warmup)) * (0.05 + 0.95 * cosine)
        batch = batch_inputs(loaded, [sample(stream) for _ in range(batch_size)],
                             image_first_flags(order_stream, batch_size, image_first_share))
        with autocast:
            lm_loss, probe_loss = forward_loss(loaded, probe, batch)
        (lm_loss + probe_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((lm_loss.item(), probe_loss.item()))
        step += 1
        if step % 50 == 0:
            lm, cells = (sum(v) / 50 for v in zip(*losses[-50:], strict=True))
            print(f"step {step} loss {lm:.4f} cell probe {cells:.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"{(time.monotonic() - started) / step:.2f}s/step", flush=True)
        if step % eval_every == 0 or step == steps or time.monotonic() >= deadline:
            scores = evaluate(loaded, validation)
            print(report(f"step {step} validation exact match", scores), flush=True)
            worst = min(scores[order]["all"] for order in trained_on)
            if worst > best:
                best, best_step = worst, step
                model.save_pretrained(out_dir, safe_serialization=True)
    print(f"kept step {best_step}: {best:.3f} on validation in its worse order")
    # The checkpoint kept, scored once on the held-out questions (never trained on, never used to choose).
    loaded = load_for_training(out_dir)
    held_out = evaluate(loaded, samples(N_HELD_OUT, HELD_OUT_SEED))
    print(report("held-out exact match (HF generate, 1,000 questions)", held_out), flush=True)
    print(f"trained in {(time.monotonic() - started) / 60:.1f} min ({step} steps)")
    return held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=27.0, help="stop early past this (slow machines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--init-from", type=Path, help="fine-tune this checkpoint instead of starting from scratch")
    parser.add_argument("--image-first-share", type=float, default=0.0,
                        help="chance that a training question puts its image before the text")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train(args.out_dir, args.steps, args.minutes, args.seed, args.batch_size, args.lr, args.eval_every,
          args.eval_samples, args.init_from, args.image_first_share)


if __name__ == "__main__":
    main()
