"""Rotary position embedding in one pass, for the Llama-style attention modules of a CPU model.

HF rotates q and k in the attention module's forward through a module-level function, ten tensor ops (two products,
a negation, a concatenation and a sum for each), each a pass over q or k and a dispatch of its own: a visible share
of the engine's op time on small text jobs (torch profiler). The C++ kernel (csrc/fused_elementwise.cpp) reads each
row once, in HF's order and roundings: its results are bit-identical to HF's in fp32 and bf16. As the rotation sits
inside the forward rather than in a module of its own, the forward itself is replaced, and only where that is safe:
for the attention classes whose forward this one restates (Llama's, Qwen2's, Mistral's: project, view, rotate,
attend, project back), and only where it gives the module's own output on a probe, run through SDPA. Anything the
kernel does not take (a batch of several rows, mixed dtypes, another device) goes through the module's own
`apply_rotary_pos_emb`.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from worker.engine.cpu_fused import agrees_at_scale
from worker.engine.families import HFModule

log = logging.getLogger(__name__)

# The attention classes whose forward RotaryFusedForward restates (transformers 5.x): Qwen2's and Mistral's
# differ from Llama's only by passing a sliding window to the attention function, each from its own place.
SLIDING_WINDOW: dict[str, Callable[[nn.Module], Any] | None] = {
    "LlamaAttention": None,
    "Qwen2Attention": lambda module: module.sliding_window,
    "MistralAttention": lambda module: getattr(module.config, "sliding_window", None),
}


class RotaryFusedForward:
    """Stands in for a Llama-style attention module's `forward` (set on the instance, so `module(...)` calls
    it): the module's own steps, with q and k rotated by the one-pass kernel."""

    def __init__(self, module: HFModule, kernels: ModuleType) -> None:
        self.module = module
        self._kernels = kernels
        modeling = sys.modules[type(module).__module__]
        self._apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = modeling.apply_rotary_pos_emb
        self._eager: Callable[..., Any] = modeling.eager_attention_forward

    def __call__(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.module
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name transformers deprecates for `cache`
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)
        query = m.q_proj(hidden_states).view(hidden_shape)  # [B, T, heads, dim]
        key = m.k_proj(hidden_states).view(hidden_shape)
        value = m.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if self._fits(query, key, cos, sin):
            rotate = self._kernels.rotary_embedding
            query = rotate(query[0], cos[0], sin[0]).unsqueeze(0).transpose(1, 2)
            key = rotate(key[0], cos[0], sin[0]).unsqueeze(0).transpose(1, 2)
        else:
            query, key = self._apply_rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, m.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(m.config._attn_implementation, self._eager)
        if (sliding_window := SLIDING_WINDOW[type(m).__name__]) is not None:
            kwargs["sliding_window"] = sliding_window(m)
        output, weights = attention(m, query, key, value, attention_mask,
                                    dropout=0.0 if not m.training else m.attention_dropout, scaling=m.scaling,
                                    **kwargs)
        output = output.reshape(*input_shape, -1).contiguous()
        return m.o_proj(output), weights

    @staticmethod
    def _fits(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """The engine's packed batch: one row of tokens, on the CPU, of one dtype, cos/sin [1, T, dim]."""
        return (query.device.type == "cpu" and query.shape[0] == 1 and key.shape[0] == 1
                and cos.dim() == 3 and cos.shape[0] == 1 and cos.shape == sin.shape
                and cos.shape[1:] == (query.shape[1], query.shape[3])
                and query.dtype == key.dtype == cos.dtype == sin.dtype and query.shape[3] % 2 == 0)


def is_rope_attention(module: nn.Module) -> bool:
    modeling = sys.modules.get(type(module).__module__)
    return (type(module).__name__ in SLIDING_WINDOW and "forward" not in vars(module)
            and callable(getattr(modeling, "apply_rotary_pos_emb", None))
            and callable(getattr(modeling, "eager_attention_forward", None))
            and all(isinstance(getattr(module, name, None), nn.Module) for name in ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"))
            and isinstance(getattr(module, "head_dim", None), int))


def _same_output(module: HFModule, fused: RotaryFusedForward) -> bool:
    """The module's forward and the stand-in on a probe of 7 tokens, both through SDPA (the engine's paged
    attention needs a step's metadata), with random rotations: equal to the last bit, or within 1e-5 of the
    output's scale in fp32 (2e-2 in bf16) should the attention's own arithmetic differ."""
    params = next(module.parameters())
    width = module.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(1, 7, width, generator=gen) * 3).to(params.dtype)
    angles = torch.randn(1, 7, module.head_dim // 2, generator=gen) * 10
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(params.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(params.dtype)
    original_config = module.config
    probe_config = copy.copy(original_config)
    probe_config._attn_implementation_internal = "sdpa"
    module.config = probe_config
    try:
        with torch.no_grad():
            want = module(hidden, (cos, sin), None)[0]
            got = fused(hidden, (cos, sin), None)[0]
    except Exception:
        log.exception("the one-pass rotary embedding's probe failed for %s", type(module).__name__)
        return False
    finally:
        module.config = original_config
    return agrees_at_scale(want, got)


def fuse_rotary(model: nn.Module, kernels: ModuleType | None, skip: Iterable[nn.Module] = ()) -> int:
    """Give each Llama-style attention module of a CPU model, outside `skip` (compiled layers), the one-pass
    rotation where its probe agrees; how many were given it."""
    params = next(model.parameters(), None)
    if kernels is None or params is None or params.device.type != "cpu":
        return 0
    skipped = {id(module) for root in skip for module in root.modules()}
    fused: list[tuple[nn.Module, RotaryFusedForward]] = []
    refused: set[str] = set()
    for module in model.modules():
        if id(module) in skipped or not is_rope_attention(module):
            continue
        stand_in = RotaryFusedForward(module, kernels)
        if _same_output(module, stand_in):
            fused.append((module, stand_in))
        else:
            refused.add(type(module).__name__)
    for module, stand_in in fused:
        module.forward = stand_in  # an instance attribute: nn.Module.__call__ looks it up before the class's
    if refused:
        log.info("kept HF's rotary embedding for %s: the one-pass kernel did not reproduce it",
                 ", ".join(sorted(refused)))
    return len(fused)
