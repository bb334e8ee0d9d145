"""Decoder layers compiled by torch.compile (EngineConfig.compile_layers, VLMQ_ENGINE_COMPILE): the engine still
gives HF `generate`'s greedy tokens with every layer compiled and attention the only graph break, and the
compiled layers' linears stay plain (inductor cannot lower oneDNN's packed op) while the vision tower's are
packed for oneDNN as before."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.worker.engine.test_engine import assert_identical, make_requests, run_engine
from worker.engine.core.config import EngineConfig
from worker.engine.cpu_linear import PackedLinear
from worker.engine.engine import Engine
from worker.engine.layer_compiler import compile_decoder_layers, decoder_layers
from worker.inference.model_loader import load_model
from worker.inference.tiny_model import TinySpec, build_tiny_llava


@pytest.fixture(scope="module")
def six_layer_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six decoder layers: more layer calls than Dynamo's default limit of 8 graphs per code object."""
    return build_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava-6", seed=3,
                            spec=replace(TinySpec(), text_layers=6))


@pytest.mark.parametrize("fixture", ["six_layer_llava", "tiny_qwen2_vl_path"])
def test_compiled_layers_match_hf_generate(fixture: str, request: pytest.FixtureRequest) -> None:
    """LLaVA (1-D RoPE, oneDNN-packed vision tower) and Qwen2-VL (M-RoPE), requests arriving while it steps, so
    batches of one token and of many go through the compiled graphs."""
    torch.set_num_threads(2)
    path: Path = request.getfixturevalue(fixture)
    engine = Engine(load_model(str(path)), EngineConfig(num_kv_blocks=512, block_size=8, max_num_batched_tokens=256,
                                                        compile_layers=True))
    layers = decoder_layers(engine.runner.language_model)
    assert engine.runner.num_compiled_layers == len(layers) > 0
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
    counters = torch._dynamo.utils.counters
    graphs_before, breaks_before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    requests = make_requests(20, seed=11)
    results = run_engine(engine, requests, seed=4)
    assert_identical(load_model(str(path)), f"compiled-{fixture}", requests, results)
    # Graphs before and after attention were compiled, and the only graph breaks were at paged attention.
    assert counters["stats"]["unique_graphs"] - graphs_before >= 2
    breaks = {reason: n for reason, n in counters["graph_break"].items() if n}
    assert sum(breaks.values()) > breaks_before
    assert all("paged_attention" in reason for reason in breaks), list(breaks)


def test_onednn_packs_the_linears_outside_the_compiled_layers(six_layer_llava: Path) -> None:
    engine = Engine(load_model(str(six_layer_llava)), EngineConfig(num_kv_blocks=64, compile_layers=True))
    inside = {id(m) for layer in decoder_layers(engine.runner.language_model) for m in layer.modules()}
    linears = [m for m in engine.runner.model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert all(type(m) is nn.Linear for m in linears if id(m) in inside)
    assert all(type(m) is PackedLinear for m in linears if id(m) not in inside)  # vision tower, projector, head
    assert any(id(m) not in inside for m in linears)


def test_a_model_without_a_layer_list_runs_eagerly() -> None:
    assert compile_decoder_layers(nn.Sequential(nn.Linear(2, 2))) == []


def test_the_setting_reaches_the_engine(tiny_llava_path: Path) -> None:
    from common.infra.settings import Settings
    from worker.context import engine_config

    assert engine_config(Settings(engine_compile=True)).compile_layers is True
    assert engine_config(Settings()).compile_layers is False
