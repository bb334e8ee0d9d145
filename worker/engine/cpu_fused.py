"""RMSNorm and the gated MLP's SiLU-and-multiply in one pass each, for the CPU backend.

HF writes RMSNorm as seven tensor ops and a Llama-style MLP's activation as two; on the CPU each is a pass over
memory with its own dispatch. The C++ versions (csrc/fused_elementwise.cpp) read and write each row once, in
HF's order of operations and roundings. A module is swapped only where it is of a known shape (a 1-d `weight`
and a `variance_epsilon`; `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn`) and where the swap gives
its own output on a probe, so an RMSNorm that computes something else (Gemma's `1 + weight`, say) keeps its
forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from worker.engine.families import HFModule

log = logging.getLogger(__name__)

SILU_CLASSES = {"SiLU", "SiLUActivation"}  # torch's and transformers' (ACT2FN["silu"])


class FusedRMSNorm(nn.Module):
    """In place of an HF RMSNorm: the same weight (so ties and dtype checks hold), the one-pass kernel."""

    def __init__(self, norm: HFModule, kernels: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.width: int = norm.weight.shape[0]
        self._original = (norm,)  # a tuple, so that the module is not registered (and visited) twice
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu":
            return self._original[0](x)  # HF promotes a mixed-dtype product; the kernel keeps one dtype
        rows = x.reshape(-1, x.shape[-1])
        return self._kernels.rms_norm(rows, self.weight.detach(), self.variance_epsilon).view(x.shape)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one pass"


class FusedGatedMLP(nn.Module):
    """In place of a Llama-style MLP, down(silu(gate(x)) * up(x)), with the activation and product fused."""

    def __init__(self, mlp: HFModule, kernels: ModuleType) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.width: int = next(mlp.gate_proj.parameters()).shape[-1]
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Both projections are this CPU model's, of its one dtype (the kernel refuses anything else).
        gate, up = self.gate_proj(x), self.up_proj(x)
        width = gate.shape[-1]
        fused = self._kernels.silu_and_mul(gate.reshape(-1, width), up.reshape(-1, width))
        return self.down_proj(fused.view(gate.shape))


def is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def is_gated_silu_mlp(module: nn.Module) -> bool:
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES)


def _probe(module: nn.Module, width: int) -> torch.Tensor:
    params = next(module.parameters())
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(5, width, generator=gen) * 3).to(params.dtype)


def _same_output(original: nn.Module, fused: nn.Module, width: int) -> bool:
    probe = _probe(original, width)
    with torch.no_grad():
        want, got = original(probe), fused(probe)
    # The sum of squares (and the sigmoid's exp) in another order: a few float ulps; a bf16 rounding flips.
    return agrees_at_scale(want, got)


def agrees_at_scale(want: torch.Tensor, got: torch.Tensor) -> bool:
    """A probe's output from a swapped module against the original's: same shape and dtype, finite, and off by at
    most 1e-5 (fp32; 2e-2 in lower precision) of the output's largest value.

    Measured against the output's scale, not element by element: a down projection sums thousands of products,
    so an activation's last-ulp difference comes out as ~1e-7 of the output's scale. Element-wise tolerances
    refused the MLPs of bench/compare.py's small model on an AMD EPYC (4.9e-4 off in outputs up to 2,601); a
    module that computes something else is off by a fair part of the scale."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return False
    tolerance = 1e-5 if want.dtype == torch.float32 else 2e-2
    want, got = want.float(), got.float()
    if not (torch.isfinite(want).all() and torch.isfinite(got).all()):
        return False
    return float((got - want).abs().max()) <= tolerance * max(1.0, float(want.abs().max()))


def fuse_elementwise(model: nn.Module, kernels: ModuleType | None, skip: Iterable[nn.Module] = ()) -> int:
    """Swap each RMSNorm and gated SiLU MLP of a CPU model, outside `skip` (compiled layers, which inductor
    fuses itself), for its one-pass version where the probe agrees; how many were swapped."""
    params = next(model.parameters(), None)
    if kernels is None or params is None or params.device.type != "cpu":
        return 0
    skipped = {id(module) for root in skip for module in root.modules()}
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    refused: set[str] = set()
    for parent in model.modules():
        if id(parent) in skipped:
            continue
        for name, child in parent.named_children():
            if is_rms_norm(child):
                fused: FusedRMSNorm | FusedGatedMLP = FusedRMSNorm(child, kernels)
            elif is_gated_silu_mlp(child):
                fused = FusedGatedMLP(child, kernels)
            else:
                continue
            if _same_output(child, fused, fused.width):
                swaps.append((parent, name, fused))
            else:
                refused.add(type(child).__name__)
    for parent, name, module in swaps:
        setattr(parent, name, module)
    if refused:
        log.info("kept HF's forward for %s: the one-pass kernel did not reproduce it", ", ".join(sorted(refused)))
    return len(swaps)
