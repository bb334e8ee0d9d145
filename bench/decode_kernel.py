"""The CPU decode attention kernel (worker/engine/csrc/paged_decode_attention.cpp) built with the project's
flags against the same source built without reassociation, and against the gather + SDPA path it replaces,
side by side on the engine's decode shapes (fp32 KV pool, 4 layers' worth of calls a timing).

    .venv/bin/python bench/decode_kernel.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from engine import cpu_name  # noqa: E402

from worker.engine import cpu_kernels  # noqa: E402
from worker.engine.attention import decode_key_mask, gathered_decode_attention  # noqa: E402

# (sequences, keys each): small's image jobs mid-decode, its text jobs, and fewer, longer sequences.
SHAPES = ((256, 110), (256, 50), (64, 300))
HEADS, KV_HEADS, DIM, BLOCK, POOL_BLOCKS, LAYERS = 8, 8, 64, 16, 8192, 4


def gather_sdpa(q, k_cache, v_cache, tables, lens, scale):
    """The engine's torch path (without the kernel)."""
    return gathered_decode_attention(q, k_cache, v_cache, tables, decode_key_mask(lens, tables.shape[1] * BLOCK),
                                     scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    plain_flags = [f for f in cpu_kernels.CFLAGS if f not in cpu_kernels.REASSOCIATION]
    systems: dict[str, Any] = {
        "kernel": cpu_kernels.paged_decode_attention(wait=True),
        "kernel, no reassociation": cpu_kernels.compile_kernel("vlmq_decode_bench_plain", plain_flags),
        "gather + SDPA": gather_sdpa,
    }
    if systems["kernel"] is None or systems["kernel, no reassociation"] is None:
        sys.exit("the kernel does not build here")
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
          f"{args.repeats}, each {LAYERS} calls (one per layer)")
    k_pool = [torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]
    v_pool = [torch.randn(POOL_BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]
    for batch, keys in SHAPES:
        width = -(-keys // BLOCK)
        tables = torch.arange(batch * width).view(batch, width)  # the allocator hands out runs of blocks
        lens = torch.randint(max(1, keys - 40), keys + 1, (batch,))
        q = torch.randn(batch, HEADS, DIM)
        reference = gather_sdpa(q, k_pool[0], v_pool[0], tables, lens, DIM**-0.5)
        times: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(args.repeats):  # alternating, so the machine's noise falls on every system alike
            for name, fn in systems.items():
                start = time.perf_counter()
                for layer in range(LAYERS):
                    fn(q, k_pool[layer], v_pool[layer], tables, lens, DIM**-0.5)
                times[name].append((time.perf_counter() - start) / LAYERS)
        base = statistics.median(times["kernel"])
        gb = int(lens.sum()) * KV_HEADS * DIM * 4 * 2 / 1e9
        print(f"\n{batch} sequences, up to {keys} keys ({gb * 1e3:.0f} MB of keys and values a call)")
        for name, fn in systems.items():
            median = statistics.median(times[name])
            error = (fn(q, k_pool[0], v_pool[0], tables, lens, DIM**-0.5) - reference).abs().max().item()
            print(f"  {name:26s} {median * 1e3:7.2f} ms  {gb / median:5.1f} GB/s  "
                  f"{median / base:5.2f}x the kernel's time  max |diff| vs SDPA {error:.1e}")


if __name__ == "__main__":
    main()
