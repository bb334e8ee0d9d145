"""HF's RMSNorm, silu(gate) * up and rotary embedding of q and k against the one-pass CPU kernels
(worker/engine/csrc/fused_elementwise.cpp), op by op, on the small model's shapes.

    .venv/bin/python bench/fused_kernels.py --rounds 7

Each round times both on the same tensors (100 calls after 10 of warm-up), alternating; prints the medians of
the rounds, the speed-up and how many output elements equal HF's exactly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from engine import cpu_name  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

from worker.engine import cpu_kernels  # noqa: E402
from worker.engine.cpu_fused import FusedRMSNorm  # noqa: E402


def hf_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up  # LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)


def hf_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """As LlamaAttention rotates its [1, heads, T, dim] views; given and returned as [T, heads, dim]."""
    q_embed, k_embed = apply_rotary_pos_emb(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin)
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


def kernel_rotary(kernels: object, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    rotate = kernels.rotary_embedding  # type: ignore[attr-defined]
    return rotate(q, cos[0], sin[0]), rotate(k, cos[0], sin[0])


def flat(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out


def per_call_us(fn: Callable[[], object], calls: int = 100) -> float:
    for _ in range(10):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.fused_elementwise(wait=True)
    if kernels is None:
        raise SystemExit("the kernels did not build (g++ and ninja needed)")
    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} threads")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(args.hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(args.hidden, generator=gen))
        norm = norm.to(dtype)
        fused = FusedRMSNorm(norm, kernels)
        for rows in (256, 4096):  # a decode step's batch; a step of prompt tokens
            x = (torch.randn(rows, args.hidden, generator=gen) * 3).to(dtype)
            gate = (torch.randn(rows, args.intermediate, generator=gen) * 4).to(dtype)
            up = torch.randn(rows, args.intermediate, generator=gen).to(dtype)
            head_dim = args.hidden // args.heads
            qk = (torch.randn(rows, 2 * args.hidden, generator=gen) * 3).to(dtype)  # two projections' outputs
            q, k = (half.view(rows, args.heads, head_dim) for half in qk.split(args.hidden, dim=1))
            angles = torch.randn(1, rows, head_dim // 2, generator=gen) * 10
            cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
            sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
            ops: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
                "rms_norm": (partial(norm, x), partial(fused, x)),
                "silu_and_mul": (partial(hf_silu_and_mul, gate, up), partial(kernels.silu_and_mul, gate, up)),
                "rotary_qk": (partial(hf_rotary, q, k, cos, sin), partial(kernel_rotary, kernels, q, k, cos, sin)),
            }
            for op, (hf, one_pass) in ops.items():
                timings: dict[str, list[float]] = {"hf": [], "kernel": []}
                for _ in range(args.rounds):
                    timings["hf"].append(per_call_us(hf))
                    timings["kernel"].append(per_call_us(one_pass))
                before, after = statistics.median(timings["hf"]), statistics.median(timings["kernel"])
                want, got = flat(hf()), flat(one_pass())  # type: ignore[arg-type]
                equal = (want == got).float().mean().item()
                width = args.intermediate if op == "silu_and_mul" else args.hidden
                print(f"{op:13s} {str(dtype).removeprefix('torch.'):9s} {rows:5d} x {width}: HF {before:7.0f} us, "
                      f"kernel {after:6.0f} us = {before / after:5.2f}x; elements equal to HF's {100 * equal:.2f}%; "
                      f"max difference {(want.float() - got.float()).abs().max().item():.2g}", flush=True)


if __name__ == "__main__":
    main()
