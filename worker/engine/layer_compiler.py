"""The language model's decoder layers compiled by torch.compile (inductor), attention left out.

Between two matmuls an HF decoder layer runs a chain of small element-wise ops: RMSNorm (a cast, a square, a
mean, a rsqrt, two products), RoPE (slices, a negation, a concatenation, products and sums on q and k), the
residual adds and SiLU times the up projection. Eagerly each is a pass over memory and a dispatch from Python;
inductor fuses each chain into one generated C++ loop (the matmuls stay library calls), as vLLM's CPU backend
compiles its models by default. Paged attention stays eager (`torch.compiler.disable`): it reads the step's
metadata, Python lists that change every step, so each layer runs as two compiled graphs, before and after
its attention call, with the packed batch's length dynamic (layers that differ only in weights share them).
The compiled layers' linears stay plain nn.Linear: inductor has no lowering for oneDNN's packed op.

It pays where a step's time is the layers' arithmetic (the small model, more so in bf16), not on tiny models,
whose steps are bound by Python; compiling costs the first steps some seconds, less from inductor's on-disk
cache (bench/engine_compile.py, docs/benchmarks.md).
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface

from worker.engine.attention import ATTN_IMPLEMENTATION, paged_attention

log = logging.getLogger(__name__)

# Graphs a layer may add: before and after its attention call, each also for a batch of one token (torch
# specialises sizes 0 and 1), and a spare.
_GRAPHS_PER_LAYER = 5


def decoder_layers(language_model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(language_model, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def compile_decoder_layers(language_model: torch.nn.Module) -> list[torch.nn.Module]:
    """Compile every decoder layer's forward in place; the layers compiled (none where the model has no
    `layers` list: it then runs eagerly)."""
    layers = decoder_layers(language_model)
    if not layers:
        log.warning("no decoder layer list on %s; the engine runs it eagerly", type(language_model).__name__)
        return []
    # Dynamo would otherwise trace into paged attention and recompile for every step's metadata.
    AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(paged_attention))
    # Dynamo keeps the graphs of every layer under one code object. Layers that differ only in their weights
    # share them (a 6-layer model compiled 8 graphs in all), but layers that differ in more (sliding-window and
    # full attention alternating, say) add their own, and past the default limit of 8 the rest would run
    # eagerly: the limit covers every layer.
    config = torch._dynamo.config
    needed = _GRAPHS_PER_LAYER * len(layers)
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, needed)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return layers
