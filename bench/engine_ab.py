"""Two builds of the engine side by side, in one process: `--pair compile`, eager against its decoder layers
compiled (VLMQ_ENGINE_COMPILE); `--pair fused`, HF's RMSNorm and MLP activation against the one-pass CPU
kernels (worker/engine/cpu_fused.py).

    .venv/bin/python bench/engine_ab.py --pair compile --models small --dtypes float32,bfloat16 --rounds 4
    .venv/bin/python bench/engine_ab.py --pair fused --models small,tiny --dtypes float32,bfloat16 --rounds 5

Both engines are built once per model and dtype (compiling is start-up: each runs a warm-up first, including a
batch of one token); then they alternate, round by round, on 256 jobs they have not seen (a new seed each
round, so no prefix-cache hits), so a drift of a shared machine hits both alike. Prints each round's seconds,
the medians, the ratio, and whether the two gave the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from compare import MODELS, make_jobs  # noqa: E402
from engine import cpu_name, new_engine  # noqa: E402

from worker.engine.allocator import keep_freed_memory  # noqa: E402
from worker.inference.tiny_model import build_tiny_llava  # noqa: E402

# Per pair: (name, new_engine's keyword arguments) of the baseline, then of the variant.
PAIRS: dict[str, tuple[tuple[str, dict[str, bool]], tuple[str, dict[str, bool]]]] = {
    "compile": (("eager", {"compile_layers": False}), ("compiled", {"compile_layers": True})),
    "fused": (("unfused", {"fused": False}), ("fused", {"fused": True})),
}


def main(default_pair: str = "compile") -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", choices=sorted(PAIRS), default=default_pair)
    parser.add_argument("--models", default="small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kinds", default="text,image")
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            path = build_tiny_llava(Path(tmp) / model, seed=0, spec=MODELS[model])
            for dtype_name in args.dtypes.split(","):
                dtype = getattr(torch, dtype_name)
                engines = {}
                (base, _), (variant, _) = PAIRS[args.pair]
                for name, options in PAIRS[args.pair]:
                    started = time.perf_counter()
                    engine = new_engine(path, dtype=dtype, **options)
                    for kind in args.kinds.split(","):
                        engine.generate(make_jobs(8, kind == "image", 4, seed=99, prefix=f"warm-{kind}"))
                        engine.generate(make_jobs(1, kind == "image", 4, seed=98, prefix=f"warm1-{kind}"))
                    engines[name] = engine
                    print(f"{model} {dtype_name} {name}: built and warmed in {time.perf_counter() - started:.1f} s",
                          flush=True)
                for kind in args.kinds.split(","):
                    seconds: dict[str, list[float]] = {name: [] for name in engines}
                    same = total = 0
                    for round_ in range(args.rounds):
                        jobs = make_jobs(args.jobs, kind == "image", args.max_tokens, seed=1000 + round_,
                                         prefix=f"r{round_}")
                        tokens = {}
                        for name, engine in engines.items():
                            started = time.perf_counter()
                            results = engine.generate(jobs)
                            seconds[name].append(time.perf_counter() - started)
                            tokens[name] = {r.request_id: r.token_ids for r in results}
                        same += sum(tokens[base][k] == tokens[variant][k] for k in tokens[base])
                        total += len(jobs)
                    before, after = (statistics.median(seconds[n]) for n in (base, variant))
                    print(f"{model} {dtype_name} {kind}: {base} {before:.2f} s, {variant} {after:.2f} s (medians of "
                          f"{args.rounds}) = {before / after:.2f}x; rounds {base} "
                          f"{' '.join(f'{s:.2f}' for s in seconds[base])}, {variant} "
                          f"{' '.join(f'{s:.2f}' for s in seconds[variant])}; same tokens {same}/{total}",
                          flush=True)


if __name__ == "__main__":
    main()
