"""Linear layers with weights pre-packed for oneDNN, for the CPU backend.

torch's F.linear on CPU hands each call to a BLAS sgemm that re-lays the weight out for its own blocking on
every call. oneDNN can keep the weight in its blocked layout once (`_reorder_linear_weight`) and multiply
against that directly (`_linear_pointwise`), as torch.compile's CPU freezing pass does: the re-layout leaves
every call, which shortens the engine's steps on text and image jobs alike (bench/engine.py), with outputs
equal to float rounding. fp32 weights only: elsewhere oneDNN's speed depends on the CPU's bf16/fp16 support.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """A drop-in for an nn.Linear that will not be trained again: same parameters (so ties and dtype checks
    hold), plus the packed copy of the weight the forward uses."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.detach() if self.bias is not None else None
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def can_pack(model: nn.Module) -> bool:
    params = next(model.parameters(), None)
    return (params is not None and params.device.type == "cpu" and params.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module, skip: Iterable[nn.Module] = ()) -> int:
    """Replace every nn.Linear of an fp32 CPU model, except those inside `skip` (compiled layers: inductor has
    no lowering for the packed op), by a PackedLinear; how many were replaced (0 where oneDNN is unavailable or
    refuses, in which case the model is left as it was)."""
    if not can_pack(model):
        return 0
    skipped = {id(module) for root in skip for module in root.modules()}
    targets = [(parent, name, child) for parent in model.modules() if id(parent) not in skipped
               for name, child in parent.named_children() if type(child) is nn.Linear]
    try:
        packed = [(parent, name, PackedLinear(child)) for parent, name, child in targets]
        probe = packed[0][2] if packed else None
        if probe is not None:  # oneDNN builds that cannot run the op fail here, before anything is replaced
            probe(torch.zeros(1, probe.in_features))
    except (RuntimeError, AttributeError) as exc:
        log.warning("linear layers not packed for oneDNN (%s); using F.linear", exc)
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)
