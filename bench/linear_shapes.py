"""What a linear layer costs by its shape on this CPU, on the small bench model's projections (hidden 512,
MLP 1,024): the first call at a new row count (oneDNN compiles a kernel per shape) against the same call once
cached, and q/k/v (gate/up) as separate matmuls against one merged matmul, in fp32 (the engine's oneDNN-packed
linears) and bf16 (plain `F.linear`).

    .venv/bin/python bench/linear_shapes.py [--repeats 5]

Fresh layers for each row count, so its first call is a first; medians of `--repeats` for the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from engine import cpu_name  # noqa: E402

from worker.engine.cpu_linear import PackedLinear  # noqa: E402

HIDDEN, MLP = 512, 1024
FIRST_ROWS = (3, 17, 129, 333, 1001, 2999)
MERGE_ROWS = (256, 1024, 4096)


def linear(out_features: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    layer = torch.nn.Linear(HIDDEN, out_features, bias=False).to(dtype)
    return PackedLinear(layer) if dtype == torch.float32 else layer


def seconds(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def first_calls(dtype: torch.dtype, repeats: int) -> None:
    print(f"\n{dtype}: [rows, {HIDDEN}] x [{HIDDEN}, {3 * HIDDEN}], ms")
    for rows in FIRST_ROWS:
        layer = linear(3 * HIDDEN, dtype)
        x = torch.randn(rows, HIDDEN, dtype=dtype)
        started = time.perf_counter()
        layer(x)
        first = time.perf_counter() - started
        cached = seconds(lambda: layer(x), 5, repeats)  # noqa: B023
        print(f"  {rows:5d} rows: first call {first * 1e3:7.2f}   cached {cached * 1e3:7.2f}   "
              f"{first / cached:5.1f}x")


def merged(dtype: torch.dtype, repeats: int) -> None:
    projections, qkv = [linear(HIDDEN, dtype) for _ in range(3)], linear(3 * HIDDEN, dtype)
    gate, up, gate_up = linear(MLP, dtype), linear(MLP, dtype), linear(2 * MLP, dtype)
    print(f"\n{dtype}: separate matmuls against one merged, ms")
    for rows in MERGE_ROWS:
        x = torch.randn(rows, HIDDEN, dtype=dtype)
        calls = max(1, 2048 // rows) * 5
        apart = seconds(lambda: [p(x) for p in projections], calls, repeats)  # noqa: B023
        one = seconds(lambda: qkv(x), calls, repeats)  # noqa: B023
        apart_mlp = seconds(lambda: (gate(x), up(x)), calls, repeats)  # noqa: B023
        one_mlp = seconds(lambda: gate_up(x), calls, repeats)  # noqa: B023
        print(f"  {rows:5d} rows: q,k,v {apart * 1e3:6.3f} -> qkv {one * 1e3:6.3f} ({apart / one:4.2f}x)   "
              f"gate,up {apart_mlp * 1e3:6.3f} -> gate_up {one_mlp * 1e3:6.3f} ({apart_mlp / one_mlp:4.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            first_calls(dtype, args.repeats)
            merged(dtype, args.repeats)


if __name__ == "__main__":
    main()
