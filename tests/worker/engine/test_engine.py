"""The paged engine against HF `generate`, token for token, on every supported family.

Requests arrive in random order over several steps; the identity must hold with a tiny KV pool (preemption),
shared prefixes, one image in many requests (encoder cache) and budgets that push images into later steps.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.hf_reference import assert_greedy_matches, hf_generate_alone, hf_greedy_with_margins
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.inference.generation import GenerationRequest, GenerationResult, InputError, SamplingParams
from worker.inference.model_loader import LoadedModel, load_model

FAMILIES = ["llava", "llava_siglip", "qwen2_vl", "qwen2_5_vl", "internvl"]
WORDS = ("describe the picture what colour is it tell me a story about this image how many shapes are there "
         "left right top bottom").split()
SYSTEM = ("You are a careful assistant that looks at every picture closely and answers questions about it "
          "with short precise sentences only.")


def _image(rng: random.Random) -> Image.Image:
    size = (rng.randint(24, 120), rng.randint(24, 120))
    im = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
    px = im.load()
    assert px is not None
    for _ in range(50):
        px[rng.randrange(size[0]), rng.randrange(size[1])] = tuple(rng.randint(0, 255) for _ in range(3))
    return im


def make_requests(n: int, seed: int, *, shared_image: Image.Image | None = None, system: bool = False
                  ) -> list[GenerationRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        if shared_image is not None:
            images = [shared_image]
        else:
            images = [_image(rng) for _ in range(2 if i % 11 == 3 else 0 if i % 7 == 5 else 1)]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages: list[dict] = [{"role": "user", "content": content}]
        if system or i % 4 == 0:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": SYSTEM}]})
        max_tokens = rng.randint(1, 24)
        requests.append(GenerationRequest(f"r{seed}-{i}", messages, images, SamplingParams(max_tokens=max_tokens)))
    return requests


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, Path]:
    fixture = {"llava": "tiny_llava_path", "llava_siglip": "tiny_llava_siglip_path",
               "qwen2_vl": "tiny_qwen2_vl_path", "qwen2_5_vl": "tiny_qwen2_5_vl_path",
               "internvl": "tiny_internvl_path"}[request.param]
    return request.param, request.getfixturevalue(fixture)


@pytest.fixture(scope="module")
def reference_model(family: tuple[str, Path]) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model(str(family[1]))


_reference_cache: dict[tuple[str, str], Reference] = {}


Reference = tuple[list[int], list[tuple[int, float]], int]


def reference(loaded: LoadedModel, family: str, req: GenerationRequest) -> Reference:
    """HF greedy tokens of the request alone, the per-step margins, and the prompt length."""
    key = (family, req.request_id)
    if key not in _reference_cache:
        tokens, margins = hf_greedy_with_margins(loaded, req.messages, req.images, req.sampling.max_tokens)
        prompt = loaded.processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        n_prompt = loaded.processor(text=prompt, images=req.images or None, return_tensors="pt")["input_ids"].shape[1]
        _reference_cache[key] = (tokens, margins, n_prompt)
    return _reference_cache[key]


def run_engine(engine: Engine, requests: list[GenerationRequest], seed: int) -> dict[str, GenerationResult]:
    """Requests arrive in random order, a few at a time, while the engine steps."""
    rng = random.Random(seed)
    pending = list(requests)
    rng.shuffle(pending)
    results: dict[str, GenerationResult] = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 5)):
            if pending:
                engine.add_request(engine.prepare(pending.pop()))
        if engine.has_unfinished():
            for result in engine.step():
                assert result.request_id not in results
                results[result.request_id] = result
    return results


def assert_identical(reference_model: LoadedModel, family: str, requests: list[GenerationRequest],
                     results: dict[str, GenerationResult]) -> None:
    assert set(results) == {r.request_id for r in requests}
    ties = 0
    for req in requests:
        tokens, margins, n_prompt = reference(reference_model, family, req)
        got = results[req.request_id]
        assert got.prompt_tokens == n_prompt, req.request_id
        if assert_greedy_matches(got.token_ids, tokens, margins, req.request_id):
            assert got.text == reference_model.tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            ties += 1
    # Near-ties are rare on these checkpoints; many of them would mean the margin check hides a real bug.
    assert ties <= max(1, len(requests) // 16), f"{ties} requests parted from HF at near-ties"


def new_engine(path: Path, **config: object) -> Engine:
    return Engine(load_model(str(path)), EngineConfig(**config))  # type: ignore[arg-type]


def test_matches_hf_generate(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    name, path = family
    requests = make_requests(36, seed=1)
    engine = new_engine(path, num_kv_blocks=512, block_size=8, max_num_batched_tokens=256)
    started = time.perf_counter()
    results = run_engine(engine, requests, seed=2)
    elapsed = time.perf_counter() - started
    assert_identical(reference_model, name, requests, results)
    # On CPU every norm and MLP of the language model ran as a one-pass kernel: two norms and an MLP a layer,
    # and the final norm (each family's LM is Llama- or Qwen2-shaped).
    layers = engine.runner.model.config.get_text_config().num_hidden_layers
    # Qwen2.5-VL's tower is built of the same RMSNorms and gated MLPs (and a norm before its merger).
    tower = 3 * engine.runner.model.config.vision_config.depth + 1 if name == "qwen2_5_vl" else 0
    assert engine.runner.num_fused_modules == 3 * layers + 1 + tower
    # RoPE in one pass in every Llama-style attention; Qwen2-VL's multimodal rotation keeps HF's.
    assert engine.runner.num_rotary_modules == (0 if name in ("qwen2_vl", "qwen2_5_vl") else layers)
    assert max(engine.runner.vision_batch_sizes) > 1  # images of several requests in one vision forward
    assert engine.block_manager.num_used_blocks == 0
    # Every step is timed as one with prompt tokens or one that only decoded (36 prompts over a 256-token budget
    # need several of the first kind; max_tokens leaves decodes alone at the end).
    stats = engine.stats
    assert stats.prefill_step_seconds > 0 and stats.decode_step_seconds > 0
    assert stats.prefill_step_seconds + stats.decode_step_seconds <= elapsed
    assert engine.metrics()["prefill_step_seconds"] == stats.prefill_step_seconds


def test_tiny_kv_pool_preempts_and_still_matches(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    name, path = family
    requests = make_requests(36, seed=1)
    engine = new_engine(path, num_kv_blocks=40, block_size=4, max_num_batched_tokens=128)
    results = run_engine(engine, requests, seed=3)
    assert_identical(reference_model, name, requests, results)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_shared_prefix_blocks_reused(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    name, path = family
    requests = make_requests(12, seed=5, system=True)
    engine = new_engine(path, num_kv_blocks=512, block_size=4, max_num_batched_tokens=512)
    for req in requests[:1]:  # the first one computes and caches the shared system prompt
        engine.add_request(engine.prepare(req))
    results = {r.request_id: r for r in _drain(engine)}
    for req in requests[1:]:
        engine.add_request(engine.prepare(req))
    results.update({r.request_id: r for r in _drain(engine)})
    assert_identical(reference_model, name, requests, results)
    assert engine.block_manager.num_prefix_hit_tokens >= 11 * 16


def test_same_image_encoded_once(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    name, path = family
    shared = _image(random.Random(9))
    requests = make_requests(16, seed=9, shared_image=shared)
    engine = new_engine(path, num_kv_blocks=512, block_size=8, max_num_batched_tokens=256,
                        enable_prefix_caching=False)
    results = run_engine(engine, requests, seed=4)
    assert_identical(reference_model, name, requests, results)
    metrics = engine.metrics()
    assert metrics["encoder_cache_misses"] == 1 and metrics["encoder_cache_hits"] >= 15
    assert metrics["vision_images"] == 1 and metrics["vision_forwards"] == 1
    assert metrics["requests_running"] == 0 and metrics["kv_blocks_used"] == 0
    assert metrics["generated_tokens"] == sum(r.completion_tokens for r in results.values())


def test_an_image_is_shared_only_within_a_salt(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    """The same image in two tenants' jobs is encoded once per tenant (their cache salts), and each tenant's
    later jobs reuse its own embeddings and prompt blocks; the tokens are HF's either way."""
    name, path = family
    shared = _image(random.Random(9))
    requests = [replace(r, cache_salt=("alice", "mallory")[i % 2])
                for i, r in enumerate(make_requests(16, seed=9, shared_image=shared))]
    engine = new_engine(path, num_kv_blocks=512, block_size=8, max_num_batched_tokens=256)
    results = run_engine(engine, requests, seed=4)
    assert_identical(reference_model, name, requests, results)
    metrics = engine.metrics()
    assert metrics["encoder_cache_misses"] == metrics["vision_images"] == 2


def test_encoder_budget_pushes_images_to_later_steps(family: tuple[str, Path], reference_model: LoadedModel
                                                     ) -> None:
    name, path = family
    requests = make_requests(16, seed=1)
    engine = new_engine(path, num_kv_blocks=512, block_size=8, max_num_batched_tokens=512,
                        max_encoder_items_per_step=1)
    results = run_engine(engine, requests, seed=6)
    assert_identical(reference_model, name, requests, results)
    assert max(engine.runner.vision_batch_sizes) == 1
    assert engine.runner.num_vision_forwards == sum(len(r.images) for r in requests)


def test_split_forward_for_vision_overlap_matches(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    """The path a GPU takes to overlap vision with decode (two forwards per step) gives the same tokens."""
    name, path = family
    requests = make_requests(20, seed=1)
    engine = new_engine(path, num_kv_blocks=512, block_size=8, max_num_batched_tokens=96,
                        max_encoder_items_per_step=3, overlap_vision=True)
    results = run_engine(engine, requests, seed=8)
    assert_identical(reference_model, name, requests, results)
    assert engine.runner.num_vision_forwards >= 6


def test_sampling_seed_is_batch_independent(family: tuple[str, Path]) -> None:
    _, path = family
    base = make_requests(6, seed=11)
    sampled = [replace(r, sampling=replace(r.sampling, temperature=0.9, top_p=0.9, top_k=50, seed=123,
                                           max_tokens=12)) for r in base]
    engine = new_engine(path, num_kv_blocks=256, block_size=8)
    together = {r.request_id: r.text for r in engine.generate(sampled)}
    alone = {r.request_id: new_engine(path, num_kv_blocks=256, block_size=8).generate([r])[0].text
             for r in sampled[:2]}
    assert all(together[k] == v for k, v in alone.items())


def test_stop_strings_and_finish_reasons(family: tuple[str, Path], reference_model: LoadedModel) -> None:
    _, path = family
    req = make_requests(1, seed=13)[0]
    req = replace(req, sampling=replace(req.sampling, max_tokens=20))
    text, _, _ = hf_generate_alone(reference_model, req.messages, req.images, 20)
    engine = new_engine(path, num_kv_blocks=128, block_size=8)
    full = engine.generate([req])[0]
    assert full.text == text and full.finish_reason == "length"
    visible = text.strip()
    if len(visible) >= 4:
        stop = visible[2:4]
        cut = text[: text.find(stop)]
        stopped = engine.generate([replace(req, request_id="stop", sampling=replace(req.sampling, stop=[stop]))])[0]
        assert stopped.text == cut and stopped.finish_reason == "stop"
        assert stopped.completion_tokens < full.completion_tokens


def _drain(engine: Engine) -> list[GenerationResult]:
    out: list[GenerationResult] = []
    while engine.has_unfinished():
        out.extend(engine.step())
    return out


def test_request_ids_can_be_reused_after_they_finish(tiny_llava_path: Path) -> None:
    engine = new_engine(tiny_llava_path, num_kv_blocks=256, block_size=8)
    requests = make_requests(6, seed=21)
    first = [r.token_ids for r in engine.generate(requests)]
    second = [r.token_ids for r in engine.generate(requests)]  # a retried job comes back under its id
    assert first == second
    assert engine.block_manager.num_used_blocks == 0 and not engine.runner.requests


def _with_text_config(source: Path, target: Path, **changes: object) -> Path:
    """A copy of a tiny LLaVA checkpoint whose decoder config is changed (same weights, same names)."""
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"].update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_sliding_window_caps_the_context_and_tokens_match_hf(tiny_llava_path: Path, tmp_path: Path) -> None:
    """A Mistral decoder with a 48-token window: up to 48 tokens sliding and full attention are one
    computation, so the engine stops each request there (finish 'length') with HF's tokens; a prompt past
    the window is refused rather than answered with tokens the model would not give."""
    path = _with_text_config(tiny_llava_path, tmp_path / "mistral", model_type="mistral", sliding_window=48)
    loaded = load_model(str(path))
    engine = Engine(loaded, EngineConfig(num_kv_blocks=256, block_size=8))
    assert engine.max_model_len == 48
    rng = random.Random(35)
    requests = [GenerationRequest(f"w{i}", [{"role": "user", "content": [
        *([{"type": "image"}] if i % 2 else []), {"type": "text", "text": f"say {i}"}]}],
        [_image(rng)] if i % 2 else [], SamplingParams(max_tokens=64)) for i in range(4)]
    fits = [engine.prepare(r) for r in requests]
    assert all(len(p.prompt_token_ids) < 40 for p in fits)
    assert all(p.request.images == [] for p in fits)  # the decoded images are not held while requests run
    for p in fits:
        engine.add_request(p)
    results = {r.request_id: r for r in _drain(engine)}
    reference_model = load_model(str(path))  # the engine's copy attends through its paged cache
    for req in requests:
        got = results[req.request_id]
        assert got.prompt_tokens + got.completion_tokens <= 48
        tokens, margins = hf_greedy_with_margins(reference_model, req.messages, req.images, got.completion_tokens)
        assert_greedy_matches(got.token_ids, tokens, margins, req.request_id)
        assert got.finish_reason == "length" or got.token_ids[-1] in loaded.eos_token_ids
    long = replace(requests[0], request_id="long", messages=[{"role": "user", "content": "word " * 60}])
    assert any(results[p.request.request_id].finish_reason == "length" for p in fits)
    with pytest.raises(InputError, match="max_model_len=48"):
        engine.add_request(engine.prepare(long))


def test_decoders_the_engine_cannot_run_fall_back(tiny_llava_path: Path, tmp_path: Path) -> None:
    from common.infra.settings import Settings
    from worker.context import make_backend
    from worker.engine.families import attention_window, get_family

    capped = load_model(str(_with_text_config(tiny_llava_path, tmp_path / "capped", attn_logit_softcapping=50.0)))
    with pytest.raises(ValueError, match="softcapping"):
        get_family(capped.model)
    backend = make_backend(capped, Settings(model="x", broker_url="memory://"))
    assert type(backend).__name__ == "BatchingGenerator"  # batched HF generate, which caps as the model does
    backend.close()
    full = SimpleNamespace(sliding_window=4096, use_sliding_window=False, layer_types=None)
    assert attention_window(full) is None
    assert attention_window(SimpleNamespace(sliding_window=64, layer_types=["full_attention"] * 2)) is None
    assert attention_window(SimpleNamespace(sliding_window=64, layer_types=["sliding_attention"])) == 64

