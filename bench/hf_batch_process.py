"""HF padded batched `generate` as a user would run it, in a process of its own: for bench/run_system.py's walls.

    python bench/hf_batch_process.py JOBS.json MODEL_DIR TOKENS.json [--batch-size 32]

Imports torch, transformers and Pillow only (none of vlmq), loads the checkpoint with transformers' own
classes and processor, and runs the jobs in padded batches of 32, each batch to its longest max_tokens, greedy,
as bench/engine.py's `hf_padded_batches` does. JOBS.json: a list of {"id", "messages", "image" (a PNG path or
null), "max_tokens"}; TOKENS.json gets each job's generated ids, cut at its max_tokens and first end token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs")
    parser.add_argument("model")
    parser.add_argument("tokens")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with open(args.jobs) as f:
        jobs = json.load(f)
    imported = time.perf_counter()
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = processor.tokenizer
    # The generation config's end tokens and the tokenizer's, as vlmq's loader takes them.
    eos = GenerationConfig.from_pretrained(args.model).eos_token_id
    eos_ids = {int(t) for t in (eos if isinstance(eos, list) else [eos]) + [tokenizer.eos_token_id] if t is not None}
    tokenizer.padding_side = "left"
    out: dict[str, list[int]] = {}
    loaded = time.perf_counter()
    for start in range(0, len(jobs), args.batch_size):
        batch = jobs[start:start + args.batch_size]
        prompts = [processor.apply_chat_template(job["messages"], add_generation_prompt=True, tokenize=False)
                   for job in batch]
        images = [Image.open(job["image"]).convert("RGB") for job in batch] if batch[0]["image"] else None
        inputs = processor(text=prompts, images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=max(job["max_tokens"] for job in batch), do_sample=False,
                                 eos_token_id=list(eos_ids), pad_token_id=tokenizer.pad_token_id)
        width = inputs["input_ids"].shape[1]
        for row, job in enumerate(batch):
            tokens = ids[row, width:].tolist()[:job["max_tokens"]]
            end = next((k for k, token in enumerate(tokens) if token in eos_ids), None)
            out[job["id"]] = tokens if end is None else tokens[:end + 1]
    with open(args.tokens, "w") as f:
        json.dump(out, f)
    print(f"loaded in {loaded - imported:.2f} s, generated in {time.perf_counter() - loaded:.2f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
