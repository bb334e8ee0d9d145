"""Which generator a worker builds: the engine in a child process by default, in-process or HF when asked."""

from __future__ import annotations

from pathlib import Path

from common.infra.settings import Settings
from worker.context import engine_process
from worker.engine.process import EngineProcess
from worker.inference.batcher import BatchingGenerator


def test_the_default_is_the_engine_in_a_child_process(tiny_llava_path: Path) -> None:
    settings = Settings(model=str(tiny_llava_path), kv_num_blocks=64, log_format="json")
    assert settings.engine_process
    generator = engine_process(settings)
    assert generator is not None
    try:
        assert isinstance(generator, EngineProcess)
        assert generator.spec.config.num_kv_blocks == 64 and generator.spec.log_format == "json"
        assert generator.spec.nice == settings.engine_nice == 5  # below the threads that feed it
    finally:
        generator.close()


def test_the_hf_backend_loads_the_model_here(tiny_llava_path: Path) -> None:
    from worker.context import make_backend
    from worker.inference.model_loader import load_model

    settings = Settings(model=str(tiny_llava_path), backend="hf")
    assert engine_process(settings) is None
    generator = make_backend(load_model(str(tiny_llava_path)), settings)
    try:
        assert isinstance(generator, BatchingGenerator)
    finally:
        generator.close()


def test_the_image_resize_setting_reaches_the_processor_that_prepares_jobs(tiny_llava_path: Path) -> None:
    from worker.inference.image_resize import torch_resize_in_use, use_torch_resize

    generator = engine_process(Settings(model=str(tiny_llava_path), kv_num_blocks=64, image_resize="pillow"))
    assert generator is not None
    try:
        assert not torch_resize_in_use()
    finally:
        generator.close()
        use_torch_resize(True)
    generator = engine_process(Settings(model=str(tiny_llava_path), kv_num_blocks=64))
    assert generator is not None
    try:
        assert torch_resize_in_use()
    finally:
        generator.close()
