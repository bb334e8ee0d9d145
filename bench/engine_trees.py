"""The engine of two checkouts side by side: each runs in a process of its own (its code on `sys.path`), the two
taking turns, so a change anywhere in the engine (not only one with a switch, as in bench/engine_ab.py) is
measured against the code before it while the shared machine drifts under both alike.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python bench/engine_trees.py --before /tmp/before --models small --turns 3 --rounds 3

Each turn builds the model's engine in a fresh process (that tree's default engine, in `--dtype`: fp32
unless told), warms it up, then runs `--rounds` rounds of 256 new jobs per kind (text, one image) and reports
their seconds. Prints every round, the medians over all turns, the speed-up, and whether the two trees
generated the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_turn(tree: Path, model: str, kinds: list[str], rounds: int, jobs: int, max_tokens: int, threads: int,
             dtype: str = "float32") -> dict[str, dict[str, object]]:
    """In a process of its own, with `tree`'s code: {kind: {"seconds": [...], "tokens": digest}}."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, __file__, "--turn", str(tree), "--models", model, "--kinds", ",".join(kinds),
            "--rounds", str(rounds), "--jobs", str(jobs), "--max-tokens", str(max_tokens), "--threads", str(threads),
            "--dtype", dtype]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TURN ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"turn in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][5:])


def turn(tree: Path, model: str, kinds: list[str], rounds: int, jobs: int, max_tokens: int, threads: int,
         dtype: str) -> None:
    sys.path[:0] = [str(tree), str(tree / "bench")]
    import torch
    from compare import MODELS, make_jobs
    from engine import new_engine

    from worker.engine.allocator import keep_freed_memory
    from worker.inference.tiny_model import build_tiny_llava

    torch.set_num_threads(threads)
    keep_freed_memory()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_llava(Path(tmp) / model, seed=0, spec=MODELS[model])
        engine = new_engine(path, dtype=getattr(torch, dtype))
        for kind in kinds:
            engine.generate(make_jobs(8, kind == "image", 4, seed=99, prefix=f"warm-{kind}"))
        report: dict[str, dict[str, object]] = {}
        for kind in kinds:
            seconds, digest = [], hashlib.sha256()
            for round_ in range(rounds):
                batch = make_jobs(jobs, kind == "image", max_tokens, seed=1000 + round_, prefix=f"r{round_}")
                started = time.perf_counter()
                results = engine.generate(batch)
                seconds.append(time.perf_counter() - started)
                for result in sorted(results, key=lambda r: r.request_id):
                    digest.update(repr((result.request_id, result.token_ids)).encode())
            report[kind] = {"seconds": seconds, "tokens": digest.hexdigest()}
    print("TURN " + json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the checkout to compare against (a git worktree)")
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--models", default="small")
    parser.add_argument("--kinds", default="text,image")
    parser.add_argument("--turns", type=int, default=3, help="processes per tree, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of new jobs per kind in each turn")
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--turn", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.turn is not None:
        turn(args.turn, args.models, kinds, args.rounds, args.jobs, args.max_tokens, args.threads, args.dtype)
        return
    if args.before is None:
        parser.error("--before is required")
    sys.path.insert(0, str(ROOT / "bench"))
    from engine import cpu_name

    print(f"CPU: {cpu_name()}; before {args.before}, after {args.after}; {args.threads} threads, {args.dtype}",
          flush=True)
    for model in args.models.split(","):
        seconds: dict[tuple[str, str], list[float]] = {}
        digests: dict[tuple[str, str], set[str]] = {}
        for number in range(args.turns):
            for name, tree in (("before", args.before), ("after", args.after)):
                report = run_turn(tree, model, kinds, args.rounds, args.jobs, args.max_tokens, args.threads,
                                  args.dtype)
                for kind, got in report.items():
                    times: list[float] = got["seconds"]  # type: ignore[assignment]
                    seconds.setdefault((name, kind), []).extend(times)
                    digests.setdefault((name, kind), set()).add(str(got["tokens"]))
                    print(f"  {model} {kind} {name} turn {number + 1}: "
                          + " ".join(f"{s:.3f}" for s in times), flush=True)
        for kind in kinds:
            before = statistics.median(seconds[("before", kind)])
            after = statistics.median(seconds[("after", kind)])
            same = digests[("before", kind)] == digests[("after", kind)]
            print(f"{model} {kind}: before {before:.3f} s, after {after:.3f} s (medians of "
                  f"{len(seconds[('before', kind)])}): {before / after:.2f}x; tokens "
                  f"{'the same' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
