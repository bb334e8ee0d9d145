"""C++ kernels of the CPU backend, compiled with torch.utils.cpp_extension (g++ and ninja) by a process of
their own, in the background, the first time a process on the machine wants them (see kernels).

Decode attention straight from the paged pool (csrc/paged_decode_attention.cpp) skips the gather that the
gather + SDPA path copies every key and value through (bench/decode_kernel.py); RMSNorm, SiLU-and-multiply and
the rotary embedding run in one pass each (csrc/fused_elementwise.cpp, used by cpu_fused.py and cpu_rope.py).
One extension holds them all (csrc/bindings.cpp), so ninja compiles the sources side by side, once per machine
and source, instead of one extension's build after the other's; the build lands in torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Where it cannot
be built (no compiler), or with EngineConfig.cpu_attention_kernel / cpu_fused_elementwise off
(VLMQ_CPU_FAST_PATHS=false), the engine keeps the pure-torch path: same results to float rounding, only slower.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
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

# Reassociation lets the softmax's sums and its exp (exp_nonpositive) vectorise, which the kernel built without it
# cannot (bench/decode_kernel.py compares the two). Not -ffast-math: that also assumes no infinities or NaNs, and
# linking with it sets flush-to-zero for the whole process, changing every other op's numbers.
REASSOCIATION = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", *REASSOCIATION]

# Builds made since builders lock with flock live in folders of their own: a process of an older vlmq (which
# took cpp_extension's lock file alone) never builds in the same folder as a newer one.
BUILD_SCHEME = b"flock-builder"
BUILDER_LOCK = "vlmq-builder.lock"
BUILD_LOG = "vlmq-build.log"
DONE = "vlmq-built"  # written once the build is complete: a .so alone may be one a killed linker left half-written
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


def paged_decode_attention(wait: bool = False) -> PagedDecodeAttention | None:
    """The compiled decode kernel, or None where the extension is not built yet or cannot be (see kernels)."""
    module = kernels(wait)
    return module.paged_decode_attention if module is not None else None


def fused_elementwise(wait: bool = False) -> ModuleType | None:
    """The module with `rms_norm`, `silu_and_mul` and `rotary_embedding`, or None where the extension is not
    built yet or cannot be (see kernels)."""
    return kernels(wait)


def kernels(wait: bool = False) -> ModuleType | None:
    """The extension, loaded from torch's cache where it is built. Where it is not: with `wait`, built here
    (tests and benches); without, built by a process of its own in the background while this one keeps the
    pure-torch path for its life (a first run on a machine is not held up by the build, and a process never
    switches paths midway); the next process loads it. None where it cannot be built."""
    with _lock:
        if PREFIX not in _loaded:
            _loaded[PREFIX] = _load(wait)
        return _loaded[PREFIX]


def _load(wait: bool) -> ModuleType | None:
    name, build_dir = _build_name()
    try:
        if not wait:
            loaded = _import_built(name, build_dir)
            if loaded is None:
                _start_background_build(build_dir)
            return loaded
        return build(name, build_dir)
    except Exception as exc:  # no compiler or headers: the torch path serves, slower
        log.warning("CPU kernels not available (%s: %s); using the pure-torch path", type(exc).__name__, exc)
        return None


def _build_name() -> tuple[str, Path]:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join(CFLAGS).encode()
                            + _cpu_signature().encode() + torch.__version__.encode() + BUILD_SCHEME)
    name = f"{PREFIX}_{digest.hexdigest()[:12]}"  # a new source, CPU, torch or scheme gets a new build
    return name, _build_directory(name)


def _build_directory(name: str) -> Path:
    """The folder cpp_extension would build `name` in (TORCH_EXTENSIONS_DIR, else torch's per-user cache
    folder, one per Python and accelerator), worked out here: importing cpp_extension imports setuptools, a
    share of every process's start-up before its model can run. The build is given this folder, so the two
    cannot differ."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs  # what cpp_extension's default root is made of (a module of its own)

        hip, cuda = torch.version.hip, torch.version.cuda
        accelerator = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / name


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Loaded directly, not through cpp_extension.load: that takes its lock file around even an up-to-date
    build. None where no complete build is there."""
    if not (build_dir / DONE).exists():
        return None
    return _import(name, build_dir / f"{name}.so")


def build(name: str | None = None, build_dir: Path | None = None) -> ModuleType:
    """Build the extension, or load the build another process finished meanwhile; one builder at a time."""
    if name is None or build_dir is None:
        name, build_dir = _build_name()
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / BUILDER_LOCK).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _build_holding_lock(name, build_dir)


def _build_holding_lock(name: str, build_dir: Path) -> ModuleType:
    """Builders take an flock on a file of the build folder, which the kernel releases when its holder dies.
    Holding it, whatever a killed build left behind (cpp_extension's own lock file, which says nothing of its
    owner and made every later start wait on it; half-written objects) is stale, and goes."""
    if (done := _import_built(name, build_dir)) is not None:
        return done
    for leftover in build_dir.iterdir():
        if leftover.name not in (BUILDER_LOCK, BUILD_LOG):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    log.info("building the CPU kernels %s (once per machine, ~1 min)", name)
    module = compile_module(name, CFLAGS, build_dir)
    (build_dir / DONE).write_text(f"{name}.so\n")
    return module


def _start_background_build(build_dir: Path) -> None:
    """A process of its own, in a session of its own (Ctrl-C on the run does not stop it, and it outlives the
    run); it exits at once where another builder holds the lock."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / BUILD_LOG).open("ab") as log_file:
        # This vlmq's code, whatever else the path would find first.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        subprocess.Popen([sys.executable, "-m", "worker.engine.cpu_kernels"], stdin=subprocess.DEVNULL,
                         stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # On stderr whatever the logging setup: the first run on a machine would otherwise be silently slower.
    print(f"vlmq: building the CPU kernels in the background (once per machine, about a minute; log in "
          f"{build_dir / BUILD_LOG}); until then this process runs the slower pure-torch path", file=sys.stderr,
          flush=True)


def compile_kernel(name: str, cflags: list[str]) -> PagedDecodeAttention:
    """The decode kernel of the extension compiled and loaded as `name` with these compiler flags
    (bench/decode_kernel.py builds a variant beside the engine's)."""
    return compile_module(name, cflags).paged_decode_attention


def compile_module(name: str, cflags: list[str], build_dir: Path | None = None) -> ModuleType:
    """`build_dir`: where to build (default: cpp_extension's folder for `name`)."""
    from torch.utils import cpp_extension

    try:
        import ninja  # the PyPI wheel's binary, for when the venv's bin/ is not on PATH

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags,
                              extra_ldflags=["-fopenmp"], verbose=False,
                              build_directory=None if build_dir is None else str(build_dir))


def _import(name: str, path: Path) -> ModuleType:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build_here_without_waiting() -> int:
    """`python -m worker.engine.cpu_kernels`: the background builder; exits where another builder holds the lock."""
    logging.basicConfig(level=logging.INFO)
    os.nice(10)  # the run it serves comes first
    name, build_dir = _build_name()
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir / BUILDER_LOCK).open("a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # another process is building it
        _build_holding_lock(name, build_dir)
    return 0


if __name__ == "__main__":
    sys.exit(_build_here_without_waiting())
