"""The one-pass RMSNorm and SiLU-and-multiply kernels against HF's modules, which modules the engine swaps for
them, and the engine's tokens with and without them."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from tests.worker.engine.test_engine import make_requests
from worker.engine import cpu_kernels
from worker.engine.core.config import EngineConfig
from worker.engine.cpu_fused import FusedGatedMLP, FusedRMSNorm, fuse_elementwise
from worker.engine.engine import Engine
from worker.inference.model_loader import load_model


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    built = cpu_kernels.fused_elementwise(wait=True)
    assert built is not None, "the kernels must build here (g++ and ninja are installed by the project)"
    return built


def _norm(cls: type[nn.Module], width: int, dtype: torch.dtype, seed: int) -> nn.Module:
    norm = cls(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(seed)))  # type: ignore[operator]
    return norm.to(dtype)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (300, 512), (2, 33, 72)])
def test_rms_norm_matches_hf(kernels: ModuleType, cls: type[nn.Module], dtype: torch.dtype,
                             shape: tuple[int, ...]) -> None:
    norm = _norm(cls, shape[-1], dtype, seed=shape[0])
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    want = norm(x)
    got = FusedRMSNorm(norm, kernels)(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:  # only the sum of squares is added in another order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # HF's two bf16 roundings, reproduced: a rounding flips only where the sum's last bit does
        assert (got == want).float().mean() > 0.999
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_rms_norm_keeps_hf_forward_for_mixed_dtypes(kernels: ModuleType) -> None:
    """An fp32 weight over bf16 activations: HF's product promotes to fp32, so the module hands over to HF."""
    norm = _norm(LlamaRMSNorm, 64, torch.float32, seed=3)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = FusedRMSNorm(norm, kernels)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_hf(kernels: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    # Both halves of one projection's output (rows strided by 2n), values from far negative to far positive.
    fused_out = (torch.randn(37, 2 * 200, generator=gen) * 10).to(dtype)
    fused_out[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    gate, up = fused_out[:, :200], fused_out[:, 200:]
    want = nn.functional.silu(gate) * up
    got = kernels.silu_and_mul(gate, up)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # the sigmoid's exp within 2 ulp of expf
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert (got == want).float().mean() > 0.999
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_kernels_keep_nan_and_refuse_bad_shapes(kernels: ModuleType) -> None:
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    out = kernels.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()  # a NaN stays a NaN, in its row only
    gate = torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16)
    assert torch.isnan(kernels.silu_and_mul(gate, torch.ones_like(gate))[0, 0])
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="one shape"):
        kernels.silu_and_mul(torch.ones(2, 8), torch.ones(2, 9))


class GemmaStyleRMSNorm(nn.Module):
    """Named like an RMSNorm, shaped like one, but scales by 1 + weight: must keep its own forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normed * (1.0 + self.weight)


class UpGatedMLP(LlamaMLP):
    """A Llama-shaped MLP that gates the other projection: must keep its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))


def test_fuse_swaps_only_what_it_reproduces(kernels: ModuleType) -> None:
    config = LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="silu")
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "norm": _norm(LlamaRMSNorm, 32, torch.float32, seed=1),
        "mlp": LlamaMLP(config),
        "gemma_norm": GemmaStyleRMSNorm(32),
        "up_gated": UpGatedMLP(config),
        "gelu_mlp": LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="gelu")),
        "compiled": nn.ModuleDict({"norm": _norm(LlamaRMSNorm, 32, torch.float32, seed=2)}),
    })
    x = torch.randn(4, 32)
    before = {name: module(x) for name, module in model.items() if name != "compiled"}
    params = {id(p) for p in model.parameters()}
    assert fuse_elementwise(model, kernels, skip=[model["compiled"]]) == 2
    assert isinstance(model["norm"], FusedRMSNorm) and isinstance(model["mlp"], FusedGatedMLP)
    assert type(model["gemma_norm"]) is GemmaStyleRMSNorm and type(model["up_gated"]) is UpGatedMLP
    assert type(model["gelu_mlp"]) is LlamaMLP and type(model["compiled"]["norm"]) is LlamaRMSNorm  # type: ignore[index]
    assert {id(p) for p in model.parameters()} == params  # the same weights, none copied or registered twice
    for name, want in before.items():
        torch.testing.assert_close(model[name](x), want, atol=1e-5, rtol=1e-5)
    assert fuse_elementwise(model, None) == 0  # no kernels built: nothing swapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_judges_by_the_output_scale(kernels: ModuleType, dtype: torch.dtype) -> None:
    """An MLP whose outputs run to thousands (random or large weights) differs from the kernel by ulps of that
    scale after its down projection: it is still swapped; a differently gated one of the same scale is not."""
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, hidden_act="silu")
    torch.manual_seed(1)
    model = nn.ModuleDict({"mlp": LlamaMLP(config), "up_gated": UpGatedMLP(config)})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(25.0)
    model = model.to(dtype)
    x = (torch.randn(6, 256) * 3).to(dtype)
    with torch.no_grad():
        want = model["mlp"](x)
    assert float(want.float().abs().max()) > 1000  # the scale at which element-wise tolerances refused the swap
    assert fuse_elementwise(model, kernels) == 1
    assert isinstance(model["mlp"], FusedGatedMLP) and type(model["up_gated"]) is UpGatedMLP
    with torch.no_grad():
        got = model["mlp"](x)
    scale = float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= (1e-5 if dtype == torch.float32 else 2e-2) * scale


def test_engine_tokens_equal_with_and_without_fused_kernels(tiny_llava_path: object) -> None:
    """Same greedy tokens (the HF-identity tests in test_engine.py run with the kernels on)."""
    requests = make_requests(24, seed=6)
    results = {}
    for fused in (True, False):
        config = EngineConfig(num_kv_blocks=256, max_num_seqs=8, cpu_fused_elementwise=fused)
        engine = Engine(load_model(str(tiny_llava_path)), config)
        layers = engine.runner.model.config.get_text_config().num_hidden_layers
        # Two norms and one MLP per decoder layer, and the final norm, in the language model.
        swapped = sum(isinstance(m, FusedRMSNorm | FusedGatedMLP) for m in engine.runner.language_model.modules())
        assert swapped == (3 * layers + 1 if fused else 0)
        assert engine.runner.num_rotary_modules == (layers if fused else 0)  # RoPE in one pass (cpu_rope.py)
        results[fused] = {r.request_id: r.token_ids for r in engine.generate(requests)}
    assert results[True] == results[False]
