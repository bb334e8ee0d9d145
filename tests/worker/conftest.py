from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.infra.db import Database, get_database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store

# tests/conftest.py sets these too (and provides the session-scoped `tiny_llava_path` CLIP checkpoint);
# repeated here so nothing under tests/worker can reach the hub even if that file changes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_first(cpu_kernels_built: None) -> None:
    """Every engine a test under tests/worker builds gets the C++ kernels (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_llava_siglip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.inference.tiny_model import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava_siglip"), seed=1, vision="siglip")


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_families import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl", seed=0)


@pytest.fixture(scope="session")
def tiny_internvl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_families import build_tiny_internvl

    return build_tiny_internvl(tmp_path_factory.mktemp("models") / "tiny-internvl", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_families import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl", seed=0, version="2.5")


# A module's database and object store, from the `settings` fixture it defines (the tests of ingestion,
# datasets, cancels and after-job work each make theirs from the service_env of tests/conftest.py).
@pytest.fixture(scope="module")
def db(settings: Settings) -> Database:
    return get_database(settings.database_url)


@pytest.fixture(scope="module")
def store(settings: Settings) -> ObjectStore:
    return make_store(settings)
