"""What `vlmq run` costs on top of the model itself: its wall against bare imports and a model load.

    .venv/bin/python bench/run_startup.py --lines 1,64 --repeats 3

Side by side, alternating, each a fresh process: `python -c "import torch, transformers"` (bare imports), the
same plus `load_model` of the demo model (imports + load: what any tool that runs the model pays before its
first token), and `vlmq run` of the first N lines of examples/shapes.jsonl on embedded defaults, in a data
folder of its own (nothing to resume), with the engine in this process, in a child process of its own, and as
`vlmq run` picks by itself. The target: a 1-line file within imports + load + 1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from engine import cpu_name  # noqa: E402

PYTHON = sys.executable
IMPORTS = "import torch, transformers"
LOAD = ("import torch, transformers\nfrom worker.inference.model_loader import load_model\n"
        "from common.infra.settings import DEMO_MODEL\nload_model(DEMO_MODEL)")


def _timed(command: list[str], env: dict[str, str]) -> float:
    """`command` in this tree, or in the baseline's (`python -m` takes its modules from the working folder)."""
    started = time.perf_counter()
    env = dict(env)
    tree = env.pop("VLMQ_BASELINE_TREE", str(ROOT))
    done = subprocess.run(command, cwd=tree, env={**env, "PYTHONPATH": tree}, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", default="1,64", help="comma-separated file sizes, in lines")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout (e.g. a git worktree of an older commit): its `vlmq run` runs "
                             "beside this tree's, as it picks by default")
    parser.add_argument("--baseline-module", default="common.cli",
                        help="the baseline tree's CLI module (common.cli before the CLI moved to cli/)")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"CPU: {cpu_name()}; {os.cpu_count()} CPUs")
    source = (ROOT / "examples" / "shapes.jsonl").read_text().splitlines(keepends=True)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    env.pop("VLMQ_ENGINE_PROCESS", None)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = {}
        for n in (int(x) for x in args.lines.split(",")):
            files[n] = work / f"lines-{n}.jsonl"
            files[n].write_text("".join(source[i % len(source)] for i in range(n)))
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "bare imports": ([PYTHON, "-c", IMPORTS], env),
            "imports + model load": ([PYTHON, "-c", LOAD], env),
        }
        for n, path in files.items():
            for label, engine_process in (("auto", None), ("engine here", "false"), ("engine child", "true")):
                run_env = dict(env) if engine_process is None else {**env, "VLMQ_ENGINE_PROCESS": engine_process}
                variants[f"vlmq run, {n} lines, {label}"] = (
                    [PYTHON, "-m", "cli", "run", str(path), "-o", str(work / "out.jsonl")], run_env)
            if args.baseline_tree is not None:
                variants[f"baseline vlmq run, {n} lines"] = (
                    [PYTHON, "-m", args.baseline_module, "run", str(path), "-o", str(work / "out.jsonl")],
                    {**env, "VLMQ_BASELINE_TREE": str(args.baseline_tree.resolve())})
        walls: dict[str, list[float]] = {label: [] for label in variants}
        for rep in range(args.repeats):
            for label, (command, run_env) in variants.items():
                run_env = {**run_env, "VLMQ_DATA_DIR": str(work / f"data-{len(walls[label])}-{abs(hash(label))}")}
                walls[label].append(_timed(command, run_env))
                print(f"  round {rep + 1}: {label}: {walls[label][-1]:.2f} s")
    base = statistics.median(walls["imports + model load"])
    print(f"\n{'variant':<40} {'median wall (s)':>16} {'over imports + load (s)':>24}")
    for label, seconds in walls.items():
        median = statistics.median(seconds)
        print(f"{label:<40} {median:>16.2f} {median - base:>+24.2f}")


if __name__ == "__main__":
    main()
