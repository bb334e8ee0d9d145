"""The CPU backend's C++ decode attention against the gather + SDPA path it replaces, and the engine with it
on and off; PackedLinear against F.linear."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.worker.engine.test_engine import make_requests
from worker.engine import cpu_kernels
from worker.engine.attention import decode_key_mask, gathered_decode_attention
from worker.engine.core.config import EngineConfig
from worker.engine.cpu_linear import PackedLinear, pack_linears
from worker.engine.engine import Engine
from worker.inference.model_loader import load_model


def _gather_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's torch path, on a float copy of the pool (the kernel takes a float query over any pool)."""
    mask = decode_key_mask(lens, tables.shape[1] * k_cache.shape[1])
    return gathered_decode_attention(q, k_cache.float(), v_cache.float(), tables, mask, scale)


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.PagedDecodeAttention:
    built = cpu_kernels.paged_decode_attention(wait=True)
    assert built is not None, "the kernel must build here (g++ and ninja are installed by the project)"
    return built


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(8, 8, 64, 16), (8, 2, 32, 16),
                                                                       (4, 1, 24, 4), (6, 3, 16, 1), (8, 8, 16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_gather_and_sdpa(kernel: cpu_kernels.PagedDecodeAttention, heads: int,
                                               kv_heads: int, dim: int, block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    batch, width, pool = 9, 7, 80
    k_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[: batch * width].view(batch, width)
    # Lengths from a single key to every slot of every block, and across block boundaries.
    lens = torch.tensor([1, 2, block_size, block_size + 1, width * block_size, 3 * block_size - 1, 5, 17, 30])
    lens = lens.clamp(1, width * block_size)
    q = torch.randn(batch, heads, dim, generator=gen)
    scale = dim**-0.5
    got = kernel(q, k_cache, v_cache, tables, lens, scale)
    want = _gather_sdpa(q, k_cache, v_cache, tables, lens, scale)
    assert got.shape == (batch, heads, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sharpness", [1e-3, 1.0, 30.0, 1e3])
def test_decode_kernel_softmax_over_any_score_range(kernel: cpu_kernels.PagedDecodeAttention,
                                                    sharpness: float) -> None:
    """The kernel's own exp (exp_nonpositive, clamped below -87): near-uniform weights, ordinary ones, and
    scores hundreds apart, where all but the best keys weigh (almost) nothing."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, dim, block_size, width = 6, 4, 32, 8, 6
    k_cache = torch.randn(40, block_size, heads, dim, generator=gen)
    v_cache = torch.randn(40, block_size, heads, dim, generator=gen)
    tables = torch.randperm(40, generator=gen)[: batch * width].view(batch, width)
    lens = torch.tensor([1, 7, 8, 9, 33, 48])
    q = torch.randn(batch, heads, dim, generator=gen) * sharpness
    got = kernel(q, k_cache, v_cache, tables, lens, dim**-0.5)
    want = _gather_sdpa(q, k_cache, v_cache, tables, lens, dim**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kernel_refuses_bad_shapes(kernel: cpu_kernels.PagedDecodeAttention) -> None:
    cache = torch.zeros(4, 16, 3, 8)
    table = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        kernel(torch.zeros(1, 4, 8), cache, cache, table, torch.ones(1), 1.0)
    with pytest.raises(RuntimeError, match="beyond its table"):  # 17 keys in one block of 16
        kernel(torch.zeros(1, 3, 8), cache, cache, table, torch.tensor([17]), 1.0)
    with pytest.raises(RuntimeError, match="needs a key"):
        kernel(torch.zeros(1, 3, 8), cache, cache, table, torch.tensor([0]), 1.0)


def test_kernel_unavailable_means_the_torch_path(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """Not built yet and no compiler: the build fails, is logged, and the engine gets None (then gathers +
    SDPA)."""
    from torch.utils import cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert cpu_kernels.paged_decode_attention(wait=True) is None


def test_settings_turn_the_fast_paths_off(tiny_llava_path: object) -> None:
    from common.infra.settings import Settings
    from worker.context import make_backend

    for fast in (True, False):
        service = make_backend(load_model(str(tiny_llava_path)), Settings(cpu_fast_paths=fast, kv_num_blocks=64))
        try:
            runner = service.engine.runner  # type: ignore[attr-defined]
            assert (runner.decode_kernel is not None) is fast
            assert any(isinstance(m, PackedLinear) for m in runner.model.modules()) is fast
            assert (runner.num_fused_modules > 0) is fast
        finally:
            service.close()


def test_engine_tokens_equal_with_and_without_the_cpu_paths(tiny_llava_path: object) -> None:
    """Same greedy tokens with the C++ decode attention and packed linears as with gather + SDPA and F.linear
    (the HF-identity tests in test_engine.py run with them on)."""
    requests = make_requests(24, seed=5)
    results = {}
    for fast in (True, False):
        config = EngineConfig(num_kv_blocks=256, max_num_seqs=8, cpu_attention_kernel=fast, cpu_packed_linear=fast)
        engine = Engine(load_model(str(tiny_llava_path)), config)
        assert (engine.runner.decode_kernel is not None) is fast
        assert any(isinstance(m, PackedLinear) for m in engine.runner.model.modules()) is fast
        results[fast] = {r.request_id: r.token_ids for r in engine.generate(requests)}
    assert results[True] == results[False]


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (37, 48), (2, 5, 48), (1, 130, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert packed.weight is linear.weight and (packed.bias is linear.bias)


def test_pack_linears_keeps_parameters_and_skips_what_it_cannot_pack() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    before = {name: p for name, p in model.named_parameters()}
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)  # type: ignore[index]
    assert {name: p for name, p in model.named_parameters()} == before
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    assert pack_linears(nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)) == 0  # fp32 only


def test_a_built_kernel_loads_without_the_build_lock(monkeypatch: pytest.MonkeyPatch,
                                                     kernel: cpu_kernels.PagedDecodeAttention) -> None:
    """Once built, the kernel is imported directly: cpp_extension.load (and its lock file, which a killed
    worker could leave behind) is not touched."""
    from torch.utils import cpp_extension

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt an up-to-date kernel")

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    assert cpu_kernels.paged_decode_attention() is not None


def test_a_build_killed_midway_leaves_nothing_that_blocks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A builder SIGKILLed mid-build leaves cpp_extension's lock file (which made every later start wait on it,
    forever) and half-written outputs; the next build goes ahead at once and starts clean."""
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, build_dir = cpu_kernels._build_name()
    build_dir.mkdir(parents=True)
    builder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, pathlib, sys, time
d = pathlib.Path({str(build_dir)!r})
held = (d / {cpu_kernels.BUILDER_LOCK!r}).open("a")
fcntl.flock(held, fcntl.LOCK_EX)
(d / "lock").touch()
(d / {name + ".so"!r}).write_bytes(b"half")
print("building", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    assert builder.stdout is not None and builder.stdout.readline() == "building\n"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert (build_dir / "lock").exists()

    def compile_cleanly(module_name: str, cflags: list[str], build_directory: Path | None = None) -> object:
        assert build_directory == build_dir
        assert module_name == name and sorted(p.name for p in build_dir.iterdir()) == [cpu_kernels.BUILDER_LOCK]
        (build_dir / f"{name}.so").write_bytes(b"built")
        return "the module"

    monkeypatch.setattr(cpu_kernels, "compile_module", compile_cleanly)
    started = time.monotonic()
    assert cpu_kernels.build() == "the module"  # type: ignore[comparison-overlap]
    assert time.monotonic() - started < 10
    assert (build_dir / cpu_kernels.DONE).exists()


@pytest.mark.timeout(900)  # a real build, on a machine whose cores the other tests share
def test_the_first_use_builds_in_the_background(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """Unbuilt, the kernels are built by a process of their own (g++ and ninja) while the
    process that wants them goes on at once on the torch path, saying so on stderr; it took the build's time,
    silently, before. A second process meanwhile starts no second build; the next one loads the build."""
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    started = time.monotonic()
    assert cpu_kernels.paged_decode_attention() is None
    assert time.monotonic() - started < 10
    assert "building the CPU kernels in the background" in capfd.readouterr().err
    name, build_dir = cpu_kernels._build_name()
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert cpu_kernels.fused_elementwise() is None  # still building
    deadline = time.monotonic() + 840
    while not (build_dir / cpu_kernels.DONE).exists():
        assert time.monotonic() < deadline, (build_dir / cpu_kernels.BUILD_LOG).read_text()[-3000:]
        time.sleep(1)
    log = (build_dir / cpu_kernels.BUILD_LOG).read_text()
    assert log.count(f"building the CPU kernels {name}") == 1, log[-3000:]
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    built = cpu_kernels.paged_decode_attention()
    assert built is not None
    cache = torch.zeros(2, 4, 1, 8)
    cache[:, :, :, 0] = 1.0
    out = built(torch.ones(1, 2, 8), cache, cache, torch.tensor([[0, 1]]), torch.tensor([5]), 1.0)
    torch.testing.assert_close(out, torch.tensor([[1.0] + [0.0] * 7] * 2).unsqueeze(0))


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(1, 8, 8), (2, 8, 8), (2, 10, 5), (3, 6, 3), (1, 4, 1)])
def test_few_sequences_split_their_kv_heads_across_tasks(kernel: cpu_kernels.PagedDecodeAttention, batch: int,
                                                         heads: int, kv_heads: int) -> None:
    """Fewer sequences than threads x 4: each sequence's kv heads are shared out between tasks (unevenly
    where they do not divide), with the same result."""
    gen = torch.Generator().manual_seed(batch * 10 + kv_heads)
    dim, block_size, width, pool = 16, 4, 40, 200
    k_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(pool, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(pool, generator=gen)[: batch * width].view(batch, width)
    lens = torch.tensor([160, 1, 77][:batch])
    q = torch.randn(batch, heads, dim, generator=gen)
    got = kernel(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(got, _gather_sdpa(q, k_cache, v_cache, tables, lens, 0.25), atol=2e-5, rtol=2e-5)


def test_the_build_folder_is_cpp_extensions_own_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worked out without importing cpp_extension (which imports setuptools at every start), and the same
    folder cpp_extension itself would pick, with and without TORCH_EXTENSIONS_DIR."""
    from torch.utils import cpp_extension

    for root in (None, "/tmp/vlmq-extensions"):
        if root is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)
        monkeypatch.setattr(os, "makedirs", lambda *args, **kwargs: None)  # cpp_extension makes the folder
        assert cpu_kernels._build_directory("vlmq_x") == Path(cpp_extension._get_build_directory("vlmq_x", False))
    script = "import sys, worker.engine.cpu_kernels as k; k._build_name(); print('setuptools' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False"
