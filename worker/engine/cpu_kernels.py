"""C++ kernels of the CPU backend, compiled on first use with torch.utils.cpp_extension (g++ and ninja).

Decode attention straight from the paged pool (csrc/paged_decode_attention.cpp) is ~2x the gather + SDPA
path on the bench's shapes (bench/engine.py); RMSNorm, SiLU-and-multiply and the rotary embedding in one pass
each (csrc/fused_elementwise.cpp, used by cpu_fused.py and cpu_rope.py). One extension holds them all
(csrc/bindings.cpp), so ninja compiles the sources side by side: ~1 min once per machine and source on 2 CPUs
(66 s, where building the two kernels as extensions of their own took 55 + 60 s one after the other); the build
lands in torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Where it cannot
be built (no compiler), or with EngineConfig.cpu_attention_kernel / cpu_fused_elementwise off
(VLMQ_CPU_FAST_PATHS=false), the engine keeps the pure-torch path: same results to float rounding, only slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "bindings.cpp", CSRC / "paged_decode_attention.cpp", CSRC / "fused_elementwise.cpp")
HEADERS = (CSRC / "exp_nonpositive.h",)
PREFIX = "vlmq_cpu_kernels"
PagedDecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                                torch.Tensor]

# Reassociation lets the softmax's sums and its exp (exp_nonpositive) vectorise: 1.12-1.15x the kernel built
# without it, on the bench's shapes. Not -ffast-math: that also assumes no infinities or NaNs, and linking with
# it sets flush-to-zero for the whole process, changing every other op's numbers.
REASSOCIATION = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", *REASSOCIATION]

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def _cpu_signature() -> str:
    """Built with -march=native: a cache shared between different CPUs must not hand one's build to another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((x for x in info.splitlines() if x.startswith(("model name", "flags"))), "")
        flags = next((x for x in info.splitlines() if x.startswith("flags")), "")
        return model + flags
    except OSError:
        return platform.processor() or platform.machine()


def paged_decode_attention() -> PagedDecodeAttention | None:
    """The compiled decode kernel, or None where the extension cannot be built (logged once)."""
    module = kernels()
    return module.paged_decode_attention if module is not None else None  # type: ignore[no-any-return]


def fused_elementwise() -> ModuleType | None:
    """The module with `rms_norm`, `silu_and_mul` and `rotary_embedding`, or None where it cannot be built
    (logged once)."""
    return kernels()


def kernels() -> ModuleType | None:
    """The extension (built on first use, then loaded from torch's cache), or None where it cannot be built."""
    with _lock:
        if PREFIX not in _loaded:
            _loaded[PREFIX] = _build()
        return _loaded[PREFIX]  # type: ignore[no-any-return]


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join(CFLAGS).encode()
                            + _cpu_signature().encode() + torch.__version__.encode())
    name = f"{PREFIX}_{digest.hexdigest()[:12]}"  # a new source, CPU or torch gets a new build
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    try:
        if built.exists():
            # Loaded directly, not through cpp_extension.load: that takes a lock file around even an
            # up-to-date build, and a worker killed while holding it would leave every later start waiting.
            return _import(name, built)
        _clear_stale_lock(build_dir)
        log.info("building the CPU kernels %s (once per machine, ~1 min)", name)
        return compile_module(name, CFLAGS)
    except Exception as exc:  # no compiler or headers: the torch path serves, slower
        log.warning("CPU kernels not available (%s: %s); using the pure-torch path", type(exc).__name__, exc)
        return None


def compile_kernel(name: str, cflags: list[str]) -> PagedDecodeAttention:
    """The decode kernel of the extension compiled and loaded as `name` with these compiler flags
    (bench/decode_kernel.py builds a variant beside the engine's)."""
    return compile_module(name, cflags).paged_decode_attention  # type: ignore[no-any-return]


def compile_module(name: str, cflags: list[str]) -> ModuleType:
    from torch.utils import cpp_extension

    try:
        import ninja  # the PyPI wheel's binary, for when the venv's bin/ is not on PATH

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES],  # type: ignore[no-any-return]
                              extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


def _import(name: str, path: Path) -> ModuleType:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _clear_stale_lock(build_dir: Path, stale_after_s: float = 600.0) -> None:
    """A lock file older than any build takes was left by a process killed mid-build."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > stale_after_s:
            lock.unlink()
            log.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass
