"""Print the requirements of one image from pyproject.toml (the single list of dependencies).

`api`: everything but the model stack, for the API, ingest worker, beat and migrate (the API never imports
torch). `worker`: everything. Used by the Dockerfile; tests/test_compose.py checks the split.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# Only a model worker needs these (worker/engine, worker/inference/model_loader, worker/inference/hf_runner).
# `tokenizers` (Rust, no torch) is not one: the API and ingestion count a prompt's tokens with it
# (common/domain/prompt_size.py).
MODEL_STACK = frozenset({"torch", "transformers", "safetensors"})


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(image: str, pyproject: Path = Path(__file__).resolve().parent.parent / "pyproject.toml") -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    if image == "worker":
        return list(deps)
    if image == "api":
        return [d for d in deps if requirement_name(d) not in MODEL_STACK]
    raise ValueError(f"unknown image {image!r}: api or worker")


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "api")))
