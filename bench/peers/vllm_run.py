"""vLLM's offline `LLM.generate` on a job file, inside the peers venv (bench/peers/setup.sh). Prints one JSON
object: generate seconds (model load and warm-up excluded), and each job's generated token ids.

    /work/peers-venv/bin/python bench/peers/vllm_run.py MODEL_DIR JOBS.json [--threads 2]

JOBS.json: {"warmup": [job, ...], "jobs": [job, ...]}, a job being {"id": ..., "prompt": text with the chat
template applied, "image": PNG path or null, "max_tokens": n}. The warm-up jobs are others than the measured
ones, so no prefix or image cache is warm for those. Greedy, in the dtype bench/compare.py runs every system in
(fp32 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("jobs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")  # every core we were given
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from PIL import Image
    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    with open(args.jobs) as f:
        spec = json.load(f)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              limit_mm_per_prompt={"image": 1}, seed=0)

    def inputs(jobs: list[dict]) -> tuple[list[dict], list[SamplingParams]]:
        prompts = []
        for job in jobs:
            prompt = {"prompt": job["prompt"]}
            if job["image"]:
                prompt["multi_modal_data"] = {"image": Image.open(job["image"]).convert("RGB")}
            prompts.append(prompt)
        return prompts, [SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]) for job in jobs]

    llm.generate(*inputs(spec["warmup"]), use_tqdm=False)  # first-call compilation is start-up, not throughput
    jobs = spec["jobs"]
    prompts, params = inputs(jobs)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "tokens": {job["id"]: list(out.outputs[0].token_ids)
                                             for job, out in zip(jobs, outputs, strict=True)}}
    sys.stdout.write("VLLM_RESULT " + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
