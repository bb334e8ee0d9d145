"""`vlmq run` and HF's padded batches as a user starts them, for bench/compare.py's `run` and `hfb_process`
systems: each a fresh process, so its wall holds imports, model load and everything after.

- `run` (run_vlmq): the jobs as an OpenAI batch file, `vlmq run FILE -o OUT --model DIR` on embedded defaults, in
  a data folder of its own, with the engine settings of bench/compare.py's engine alone (KV blocks, sequences,
  tokens per step) and its threads. Its seconds are the run phase `vlmq run` prints once its model was loaded
  (the engine alone's timing also starts with its model loaded), to the batch's end; the whole run phase
  (the model loads while the input is stored and checked) and the wall are printed beside them.
- `hfb_process` (run_hf_process): bench/hf_batch_process.py, HF padded batched `generate` in batches of 32 with
  transformers' own classes; its seconds are the process's wall.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SETTINGS = {"VLMQ_KV_NUM_BLOCKS": "8192", "VLMQ_MAX_NUM_SEQS": "256", "VLMQ_MAX_NUM_BATCHED_TOKENS": "4096"}
# `vlmq run` prints "...; 1.23s (1.01s once the model was loaded), 207.50 jobs/s, ..." when it is done.
_RUN_PHASE = re.compile(r"; (\d+\.\d+)s \((\d+\.\d+)s once the model was loaded\)")


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLMQ_")}
    return {**env, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}


def run_vlmq(path: Path, lines: list[dict[str, Any]], threads: int, work: Path, dtype: str
             ) -> tuple[float, float, float, dict[str, str]]:
    """(run phase, its part once the model was loaded, wall, custom_id -> answer text) of one `vlmq run` of
    `lines` (OpenAI batch input lines)."""
    work.mkdir(parents=True, exist_ok=True)
    source, output = work / "input.jsonl", work / "output.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {**_env(threads), **ENGINE_SETTINGS, "VLMQ_DEVICE": "cpu", "VLMQ_DTYPE": dtype, "COLUMNS": "1000"}
    command = [sys.executable, "-m", "cli.main", "run", str(source), "-o", str(output), "--model", str(path),
               "--data-dir", str(work / "data")]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0 or (match := _RUN_PHASE.search(done.stderr)) is None:
        raise RuntimeError(f"vlmq run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    texts = {}
    for raw in output.read_text().splitlines():
        row = json.loads(raw)
        texts[row["custom_id"]] = row["response"]["body"]["choices"][0]["message"]["content"]
    return float(match[1]), float(match[2]), wall, texts


def run_hf_process(path: Path, jobs: list[dict[str, Any]], threads: int, work: Path, dtype: str
                   ) -> tuple[float, dict[str, list[int]]]:
    """(wall, job id -> generated ids) of bench/hf_batch_process.py on `jobs` ({"id", "messages", "image": a
    PNG path or None, "max_tokens"})."""
    work.mkdir(parents=True, exist_ok=True)
    source, tokens = work / "jobs.json", work / "tokens.json"
    source.write_text(json.dumps(jobs))
    command = [sys.executable, str(ROOT / "bench" / "hf_batch_process.py"), str(source), str(path), str(tokens),
               "--dtype", dtype]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=_env(threads), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"HF batches failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"  hfb_process: wall {wall:.2f} s; {done.stderr.strip().splitlines()[-1]}")
    return wall, json.loads(tokens.read_text())
