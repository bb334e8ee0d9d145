"""The one-pass rotary embedding against HF's `apply_rotary_pos_emb`, and which attention modules the engine
gives it."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

from worker.engine import cpu_kernels
from worker.engine.cpu_rope import RotaryFusedForward, fuse_rotary


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    built = cpu_kernels.fused_elementwise(wait=True)
    assert built is not None, "the kernels must build here (g++ and ninja are installed by the project)"
    return built


def _rotations(tokens: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(1, tokens, dim // 2, generator=torch.Generator().manual_seed(seed)) * 10
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 4, 4, 16), (37, 8, 2, 64), (300, 6, 3, 128)])
def test_kernel_is_bit_identical_to_hf(kernels: ModuleType, dtype: torch.dtype, tokens: int, heads: int,
                                       kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    # q and k as the views of one fused projection's output: token strides wider than their rows.
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    cos, sin = _rotations(tokens, dim, dtype, seed=tokens + 1)
    want_q, want_k = apply_rotary_pos_emb(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos, sin)
    got_q = kernels.rotary_embedding(q, cos[0], sin[0])
    got_k = kernels.rotary_embedding(k, cos[0], sin[0])
    assert got_q.is_contiguous() and got_q.dtype == dtype
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_kernel_refuses_what_it_cannot_rotate(kernels: ModuleType) -> None:
    x = torch.randn(5, 2, 8)
    cos, sin = _rotations(5, 8, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="even"):
        kernels.rotary_embedding(torch.randn(5, 2, 7), torch.ones(5, 7), torch.ones(5, 7))
    with pytest.raises(RuntimeError, match="tokens, dim"):
        kernels.rotary_embedding(x, cos[0, :4], sin[0, :4])
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rotary_embedding(x, cos[0].double(), sin[0].double())
    with pytest.raises(RuntimeError, match="contiguous dim"):
        kernels.rotary_embedding(x.transpose(1, 2), cos[0], sin[0])


def _attention(cls: type[nn.Module], dtype: torch.dtype = torch.float32) -> nn.Module:
    config_cls = {Qwen2Attention: Qwen2Config, MistralAttention: MistralConfig}.get(cls, LlamaConfig)
    config = config_cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return cls(config, layer_idx=0).to(dtype)


def _run(module: nn.Module, batch: int, dtype: torch.dtype) -> torch.Tensor:
    hidden = torch.randn(batch, 9, 64, generator=torch.Generator().manual_seed(batch)).to(dtype)
    cos, sin = _rotations(9, 16, dtype, seed=batch)
    with torch.no_grad():
        return module(hidden, (cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)), None)[0]


class InterleavedRopeAttention(LlamaAttention):
    """Named and shaped like Llama's, but rotating pairs of neighbours (GPT-J style): must keep its forward."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return x * cos + pairs * sin

        out = torch.nn.functional.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True,
                                                               enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


InterleavedRopeAttention.__name__ = "LlamaAttention"
InterleavedRopeAttention.__module__ = modeling_llama.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_gives_the_kernel_only_where_it_reproduces_the_module(kernels: ModuleType, dtype: torch.dtype) -> None:
    model = nn.ModuleDict({"llama": _attention(LlamaAttention, dtype), "qwen2": _attention(Qwen2Attention, dtype),
                           "mistral": _attention(MistralAttention, dtype),
                           "interleaved": _attention(InterleavedRopeAttention, dtype),
                           "compiled": nn.ModuleDict({"llama": _attention(LlamaAttention, dtype)})})
    before = {name: _run(model[name], 1, dtype) for name in ("llama", "qwen2", "mistral", "interleaved")}
    assert fuse_rotary(model, kernels, skip=[model["compiled"]]) == 3
    for name in ("llama", "qwen2", "mistral"):
        assert isinstance(vars(model[name]).get("forward"), RotaryFusedForward), name
    assert "forward" not in vars(model["interleaved"]) and "forward" not in vars(model["compiled"]["llama"])  # type: ignore[index]
    for name, want in before.items():  # the module's output unchanged, to the last bit
        assert torch.equal(_run(model[name], 1, dtype), want), name
    # A batch of several rows is not the engine's packed one: HF's rotation, the same output.
    fused = _run(model["llama"], 3, dtype)
    del vars(model["llama"])["forward"]
    assert torch.equal(fused, _run(model["llama"], 3, dtype))
    assert fuse_rotary(model, None) == 0  # no kernels built: nothing given
