"""Engine throughput against HF baselines, side by side in one process run.

    python bench/engine.py [--jobs 256] [--models tiny,small] [--threads 2]

Workload: N jobs, one image each (sizes vary), prompts of 10-60 tokens, max_tokens 8-128, greedy, all
submitted at once. Systems: (a) HF `generate` one job at a time, (b) HF padded batched `generate` in fixed
batches of 32 (each batch runs to its longest max_tokens), (c) the vlmq engine. Prints jobs/s, generated
tokens/s and the ratios c/a and c/b, plus agreement of (c) with (a) token for token.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from PIL import Image

from worker.engine.allocator import keep_freed_memory
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.inference.generation import GenerationRequest, SamplingParams
from worker.inference.model_loader import LoadedModel, load_model
from worker.inference.tiny_model import TinySpec, build_tiny_llava

SPECS = {
    "tiny": TinySpec(),
    "small": TinySpec(image_size=112, patch_size=14, vision_hidden=256, vision_layers=4, text_hidden=512,
                      text_layers=4, text_heads=8, text_kv_heads=8, max_positions=1024),
}
WORDS = ("describe the picture what colour is it tell me a story about this image how many shapes are there "
         "left right top bottom small large round square red green blue").split()


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        amx = "amx_tile" in out
        return f"{name} ({os.cpu_count()} cpus, AMX {'yes' if amx else 'no'})"
    except Exception:
        return platform.processor() or "unknown"


def make_jobs(n: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        size = (rng.randint(32, 256), rng.randint(32, 256))
        image = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 50)))
        content = [{"type": "image"}, {"type": "text", "text": words}]
        jobs.append(GenerationRequest(f"job-{i}", [{"role": "user", "content": content}], [image],
                                      SamplingParams(max_tokens=rng.randint(8, 128))))
    return jobs


def hf_one_at_a_time(loaded: LoadedModel, jobs: list[GenerationRequest]) -> dict[str, list[int]]:
    out = {}
    for job in jobs:
        prompt = loaded.processor.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
        inputs = loaded.processor(text=prompt, images=job.images or None, return_tensors="pt")
        with torch.inference_mode():
            ids = loaded.model.generate(**inputs, max_new_tokens=job.sampling.max_tokens, do_sample=False,
                                        eos_token_id=loaded.eos_token_ids, pad_token_id=loaded.tokenizer.pad_token_id)
        out[job.request_id] = _cut(ids[0, inputs["input_ids"].shape[1]:].tolist(), job, loaded)
    return out


def hf_padded_batches(loaded: LoadedModel, jobs: list[GenerationRequest], batch_size: int = 32
                      ) -> dict[str, list[int]]:
    out = {}
    tokenizer = loaded.processor.tokenizer
    tokenizer.padding_side = "left"
    for i in range(0, len(jobs), batch_size):
        batch = jobs[i : i + batch_size]
        prompts = [loaded.processor.apply_chat_template(j.messages, add_generation_prompt=True, tokenize=False)
                   for j in batch]
        images = [j.images[0] for j in batch] if batch[0].images else None  # text-only jobs: no images
        inputs = loaded.processor(text=prompts, images=images, return_tensors="pt", padding=True)
        with torch.inference_mode():
            ids = loaded.model.generate(**inputs, max_new_tokens=max(j.sampling.max_tokens for j in batch),
                                        do_sample=False, eos_token_id=loaded.eos_token_ids,
                                        pad_token_id=tokenizer.pad_token_id)
        width = inputs["input_ids"].shape[1]
        for row, job in enumerate(batch):
            out[job.request_id] = _cut(ids[row, width:].tolist(), job, loaded)
    return out


def _cut(tokens: list[int], job: GenerationRequest, loaded: LoadedModel) -> list[int]:
    tokens = tokens[: job.sampling.max_tokens]
    for k, tok in enumerate(tokens):
        if tok in loaded.eos_token_ids:
            return tokens[: k + 1]
    return tokens


def new_engine(path: Path, cpu_paths: bool = True, dtype: torch.dtype = torch.float32,
               compile_layers: bool = False, torch_resize: bool = True, fused: bool | None = None) -> Engine:
    """`cpu_paths=False`: without the C++ decode attention and the oneDNN-packed linears (the pure-torch
    engine, for side-by-side runs); `fused`: the one-pass RMSNorm and SiLU kernels (default: as `cpu_paths`);
    `compile_layers`: decoder layers compiled by torch.compile; `torch_resize`:
    the image processor resizes with torch's kernel, else Pillow (process-wide, worker/inference/image_resize.py)."""
    config = EngineConfig(num_kv_blocks=8192, block_size=16, max_num_seqs=256, max_num_batched_tokens=4096,
                          cpu_attention_kernel=cpu_paths, cpu_packed_linear=cpu_paths,
                          cpu_fused_elementwise=cpu_paths if fused is None else fused, compile_layers=compile_layers)
    return Engine(load_model(str(path), dtype=dtype, torch_resize=torch_resize), config)


def vlmq_engine(engine: Engine, jobs: list[GenerationRequest]) -> dict[str, list[int]]:
    results = engine.generate(jobs)
    return {r.request_id: r.token_ids for r in results}


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


def bench_model(name: str, path: Path, n_jobs: int, repeats: int) -> None:
    jobs = make_jobs(n_jobs)
    hf = load_model(str(path))
    rows: dict[str, list[float]] = {"hf_one_at_a_time": [], "hf_padded_batch32": [], "vlmq_engine": []}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        a, ta = timed(hf_one_at_a_time, hf, jobs)
        b, tb = timed(hf_padded_batches, hf, jobs)
        engine = new_engine(path)  # model load and KV allocation are start-up, not throughput
        c, tc = timed(vlmq_engine, engine, jobs)
        rows["hf_one_at_a_time"].append(ta)
        rows["hf_padded_batch32"].append(tb)
        rows["vlmq_engine"].append(tc)
        tokens = {"hf_one_at_a_time": sum(map(len, a.values())), "hf_padded_batch32": sum(map(len, b.values())),
                  "vlmq_engine": sum(map(len, c.values()))}
    same = sum(a[j.request_id] == c[j.request_id] for j in jobs)
    print(f"\n## {name}: {n_jobs} jobs, one image each, greedy; median of {repeats} run(s)")
    print(f"{'system':<20}{'seconds':>10}{'jobs/s':>10}{'gen tok/s':>12}")
    medians = {k: statistics.median(v) for k, v in rows.items()}
    for system, seconds in medians.items():
        print(f"{system:<20}{seconds:>10.2f}{n_jobs / seconds:>10.2f}{tokens[system] / seconds:>12.1f}")
    print(f"ratio c/a (engine vs one at a time): {medians['hf_one_at_a_time'] / medians['vlmq_engine']:.2f}x")
    print(f"ratio c/b (engine vs padded batch 32): {medians['hf_padded_batch32'] / medians['vlmq_engine']:.2f}x")
    print(f"engine outputs identical to HF one-at-a-time: {same}/{n_jobs}")
    print(f"engine: {engine.stats.num_steps} steps, vision batches max {max(engine.runner.vision_batch_sizes)}, "
          f"preemptions {engine.scheduler.num_preemptions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from worker.engine import cpu_kernels

    cpu_kernels.kernels(wait=True)  # built before any timing: a process that finds them unbuilt runs the torch path
    keep_freed_memory()  # before any system runs, so the baselines get the same allocator as the engine
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads, fp32")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = build_tiny_llava(Path(tmp) / name, seed=0, spec=SPECS[name])
            bench_model(name, path, args.jobs, args.repeats)


if __name__ == "__main__":
    main()
