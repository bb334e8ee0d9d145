"""Tiny Qwen2-VL and InternVL checkpoints, built offline once per session (tiny LLaVA CLIP/SigLIP come from the
conftest files above)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.tiny_model import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl", seed=0)


@pytest.fixture(scope="session")
def tiny_internvl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.tiny_model import build_tiny_internvl

    return build_tiny_internvl(tmp_path_factory.mktemp("models") / "tiny-internvl", seed=0)
