"""The engine on a GPU: the same identity checks on CUDA, with vision on its own stream. Skipped without CUDA
(the CPU suite checks the same split-forward path with overlap_vision=True)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.engine.test_engine import make_requests, run_engine
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.inference.model_loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("fixture", ["tiny_llava_path", "tiny_qwen2_vl_path", "tiny_internvl_path"])
def test_cuda_engine_matches_cpu_engine(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    requests = make_requests(24, seed=1)
    cpu = run_engine(Engine(load_model(str(path)), EngineConfig(num_kv_blocks=512, block_size=8)), requests, 2)
    gpu_engine = Engine(load_model(str(path), device="cuda"), EngineConfig(num_kv_blocks=512, block_size=8))
    assert gpu_engine.runner.vision_stream is not None
    gpu = run_engine(gpu_engine, requests, 2)
    same = sum(cpu[r.request_id].token_ids == gpu[r.request_id].token_ids for r in requests)
    assert same >= len(requests) - 2  # fp32 on different hardware: at most a near-tie or two may part
