from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from worker.inference.generation import GenerationRequest, GenerationResult, InputError, SamplingParams
from worker.inference.hf_runner import HFBatchRunner
from worker.inference.model_loader import LoadedModel, load_model

_WORD_TEXT = (
    "describe the picture what colour is it tell me a story about this image how many shapes are there"
)
_WORDS = _WORD_TEXT.split()


@pytest.fixture(scope="module")
def loaded(tiny_llava_path: Path) -> LoadedModel:
    torch.set_num_threads(2)
    return load_model(str(tiny_llava_path))


@pytest.fixture(scope="module")
def runner(loaded: LoadedModel) -> HFBatchRunner:
    return HFBatchRunner(loaded)


def _image(rng: random.Random) -> Image.Image:
    size = (rng.randint(16, 96), rng.randint(16, 96))
    im = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
    px = im.load()
    assert px is not None
    # Speckles, so images of one colour still differ after the processor's resize and crop.
    for _ in range(40):
        px[rng.randrange(size[0]), rng.randrange(size[1])] = tuple(rng.randint(0, 255) for _ in range(3))
    return im


def _requests(n: int = 20, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        n_images = 2 if i == 7 else (0 if i % 5 == 4 else 1)
        images = [_image(rng) for _ in range(n_images)]
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10)))
        if images:
            content: list[dict] | str = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        else:
            content = text  # plain-string content, as HF chat format allows
        messages: list[dict] = [{"role": "user", "content": content}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]})
        max_tokens = 4 + (i * 7) % 21  # 4..24, shuffled so long and short requests sit side by side
        requests.append(
            GenerationRequest(f"req-{i}", messages, images, SamplingParams(max_tokens=max_tokens))
        )
    return requests


def _reference(loaded: LoadedModel, req: GenerationRequest) -> tuple[list[int], int]:
    """Plain HF generate on one request alone, cut after the first EOS like the runner."""
    processor = loaded.processor
    prompt = processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=req.images or None, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(
            **inputs,
            max_new_tokens=req.sampling.max_tokens,
            do_sample=False,
            eos_token_id=loaded.eos_token_ids,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
    prompt_len = inputs["input_ids"].shape[1]
    new = out[0, prompt_len:].tolist()
    for k, tok in enumerate(new):
        if tok in loaded.eos_token_ids:
            return new[: k + 1], prompt_len
    return new, prompt_len


def _run(runner: HFBatchRunner, requests: list[GenerationRequest]) -> list[GenerationResult]:
    prepared = [runner.prepare(r) for r in requests]
    # The processor's outputs hold the pixels: the decoded images are not kept while requests wait and run.
    assert all(p.request.images == [] for p in prepared)
    return runner.generate(prepared)


def test_batched_greedy_matches_single_request_generate(loaded: LoadedModel, runner: HFBatchRunner) -> None:
    requests = _requests()
    assert sum(len(r.images) for r in requests) == 17  # 4 text-only, one with 2 images
    results = _run(runner, requests)

    assert [r.request_id for r in results] == [q.request_id for q in requests]
    for req, res in zip(requests, results, strict=True):
        expected, prompt_len = _reference(loaded, req)
        assert res.token_ids == expected, req.request_id
        assert res.prompt_tokens == prompt_len
        assert res.completion_tokens == len(res.token_ids)
        assert res.text == loaded.tokenizer.decode(expected, skip_special_tokens=True)
        if expected and expected[-1] in loaded.eos_token_ids:
            assert res.finish_reason == "stop"
        else:
            assert res.finish_reason == "length"
            assert res.completion_tokens == req.sampling.max_tokens
    # A degenerate tiny model (one token repeated everywhere) would make the equality above meaningless.
    assert len({tuple(r.token_ids) for r in results}) >= 18
    assert len({t for r in results for t in r.token_ids}) >= 60


def test_siglip_tower_batched_greedy_matches_reference(tiny_llava_siglip_path: Path) -> None:
    # SigLIP has no CLS token ("full" feature selection): a different placeholder count per image than CLIP.
    loaded = load_model(str(tiny_llava_siglip_path))
    requests = _requests(8, seed=23)
    results = _run(HFBatchRunner(loaded), requests)
    for req, res in zip(requests, results, strict=True):
        assert res.token_ids == _reference(loaded, req)[0], req.request_id


def test_batch_composition_does_not_change_greedy_output(runner: HFBatchRunner) -> None:
    requests = _requests(8, seed=3)
    together = _run(runner, requests)
    reordered = _run(runner, requests[::-1])[::-1]
    alone = [_run(runner, [r])[0] for r in requests[:3]]
    assert [r.token_ids for r in together] == [r.token_ids for r in reordered]
    assert [r.token_ids for r in together[:3]] == [r.token_ids for r in alone]


def test_eos_cuts_output_and_still_matches_reference(loaded: LoadedModel) -> None:
    requests = _requests(10, seed=5)
    plain = _run(HFBatchRunner(loaded), requests)
    # The random model never picks its real EOS, so declare a token it does emit mid-answer to be one.
    fake_eos = plain[0].token_ids[len(plain[0].token_ids) // 2]
    with_eos = dataclasses.replace(loaded, eos_token_ids=[*loaded.eos_token_ids, fake_eos])
    results = _run(HFBatchRunner(with_eos), requests)

    stopped = 0
    for req, res in zip(requests, results, strict=True):
        expected, _ = _reference(with_eos, req)
        assert res.token_ids == expected, req.request_id
        if fake_eos in res.token_ids:
            stopped += 1
            assert res.finish_reason == "stop"
            assert res.token_ids[-1] == fake_eos
            assert res.token_ids.count(fake_eos) == 1
    assert stopped >= 1


def test_stop_string_truncates_text(runner: HFBatchRunner) -> None:
    requests = _requests(10, seed=7)
    for r in requests:
        r.sampling.max_tokens = 24
    baseline = _run(runner, requests)
    # Pick an ASCII word from the middle of some answer, so decoding a token prefix cannot split a character.
    candidates = [
        (req, base, m.group())
        for req, base in zip(requests, baseline, strict=True)
        for m in re.finditer(r"[A-Za-z0-9]{3,}", base.text)
        if m.start() > 0
    ]
    assert candidates, "no usable stop word in any answer"
    req, base, stop = candidates[0]
    stopped_req = dataclasses.replace(
        req, sampling=dataclasses.replace(req.sampling, stop=["@@never@@", stop])
    )
    res = _run(runner, [stopped_req, *requests[:3]])[0]

    assert res.finish_reason == "stop"
    assert res.text == base.text[: base.text.find(stop)]
    assert stop not in res.text
    assert base.token_ids[: len(res.token_ids)] == res.token_ids
    assert len(res.token_ids) < len(base.token_ids) or base.text.endswith(stop)
    assert res.completion_tokens == len(res.token_ids)


def test_max_tokens_gives_length(runner: HFBatchRunner) -> None:
    requests = _requests(3, seed=11)
    for r, n in zip(requests, (1, 5, 9), strict=True):
        r.sampling.max_tokens = n
    results = _run(runner, requests)
    assert [r.completion_tokens for r in results] == [1, 5, 9]
    assert all(r.finish_reason == "length" for r in results)


def test_seeded_sampling_is_reproducible(runner: HFBatchRunner) -> None:
    requests = _requests(6, seed=13)
    for i, r in enumerate(requests):
        r.sampling = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1234 if i < 2 else None)
    first = _run(runner, requests)
    # Same seeds in a different batch (other neighbours, other order): same text.
    second = _run(runner, [requests[1], *_requests(3, seed=17), requests[0]])
    assert second[-1].text == first[0].text and second[-1].token_ids == first[0].token_ids
    assert second[0].text == first[1].text

    greedy = _run(runner, [dataclasses.replace(requests[0], sampling=SamplingParams(max_tokens=16))])[0]
    other_seeds = [
        _run(
            runner,
            [dataclasses.replace(requests[0], sampling=dataclasses.replace(requests[0].sampling, seed=s))],
        )[0]
        for s in (1, 2, 3)
    ]
    assert len({tuple(r.token_ids) for r in [first[0], greedy, *other_seeds]}) >= 3


@pytest.mark.parametrize(
    ("content", "n_images"),
    [
        ([{"type": "image"}, {"type": "text", "text": "what is this"}], 0),
        ([{"type": "image"}, {"type": "text", "text": "what is this"}], 2),
        ([{"type": "text", "text": "no image part"}], 1),
        ("plain text", 1),
        # The placeholder typed as text would shift images into the wrong slot.
        ([{"type": "image"}, {"type": "text", "text": "compare with <image> please"}], 1),
    ],
)
def test_image_count_mismatch_is_input_error(runner: HFBatchRunner, content: object, n_images: int) -> None:
    rng = random.Random(0)
    req = GenerationRequest(
        "bad", [{"role": "user", "content": content}], [_image(rng) for _ in range(n_images)]
    )
    with pytest.raises(InputError):
        runner.prepare(req)


def test_prompt_longer_than_context_is_input_error(runner: HFBatchRunner, loaded: LoadedModel) -> None:
    assert loaded.max_positions is not None
    text = "the cat " * loaded.max_positions
    with pytest.raises(InputError, match="prompt"):
        runner.prepare(GenerationRequest("long", [{"role": "user", "content": text}], []))


def test_max_tokens_is_clamped_to_the_context(runner: HFBatchRunner, loaded: LoadedModel) -> None:
    assert loaded.max_positions is not None
    text = "the cat " * (loaded.max_positions // 2 - 20)
    req = GenerationRequest(
        "near-limit", [{"role": "user", "content": text}], [], SamplingParams(max_tokens=500)
    )
    prepared = runner.prepare(req)
    room = loaded.max_positions - prepared.prompt_tokens
    assert 0 < room < 500
    assert prepared.max_new_tokens == room
    res = runner.generate([prepared, runner.prepare(_requests(1)[0])])[0]
    assert res.completion_tokens <= room
    if res.finish_reason == "length":
        assert res.completion_tokens == room


def test_bad_sampling_params_are_input_errors(runner: HFBatchRunner) -> None:
    for sampling in (
        SamplingParams(max_tokens=0),
        SamplingParams(top_p=0.0),
        SamplingParams(temperature=-1.0),
    ):
        with pytest.raises(InputError):
            runner.prepare(GenerationRequest("bad", [{"role": "user", "content": "hi"}], [], sampling))


def test_extreme_but_valid_sampling_values_run(runner: HFBatchRunner) -> None:
    """A temperature or top_p that float32 cannot tell from 0, and seeds at int64's ends, are valid requests:
    the first two give the most likely tokens, the seeds seed a generator."""
    request = _requests(1, seed=23)[0]
    greedy = _run(runner, [dataclasses.replace(request, sampling=SamplingParams(max_tokens=8))])[0]
    extremes = [SamplingParams(max_tokens=8, temperature=1e-40), SamplingParams(max_tokens=8, temperature=5e-324),
                SamplingParams(max_tokens=8, temperature=1.0, top_p=5e-324, seed=-(2**63)),
                SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=2**63 - 1)]
    results = _run(runner, [dataclasses.replace(request, request_id=f"x{i}", sampling=s)
                            for i, s in enumerate(extremes)])
    assert [r.token_ids for r in results] == [greedy.token_ids] * len(extremes)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from tests.worker.tiny_others import build_tiny_gemma3

    return load_model(str(build_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3")))


def test_models_that_cannot_batch_embeddings_run_each_request_through_generate(
        gemma3: LoadedModel, tiny_qwen2_vl_path: Path) -> None:
    """Gemma3 (its generate takes no inputs_embeds; image tokens attend both ways by token_type_ids) and an
    M-RoPE model the engine does not know (a Qwen2-VL posing as Qwen3-VL): each request alone, HF's tokens."""
    qwen = load_model(str(tiny_qwen2_vl_path))
    qwen.model.config.model_type = "qwen3_vl"
    for loaded in (gemma3, qwen):
        runner = HFBatchRunner(loaded)
        assert not runner.batchable
        requests = _requests(8, seed=29)
        results = _run(runner, requests)
        assert [r.request_id for r in results] == [q.request_id for q in requests]
        for req, res in zip(requests, results, strict=True):
            expected, prompt_len = _reference(loaded, req)
            assert res.token_ids == expected and res.prompt_tokens == prompt_len, req.request_id
        sampled = dataclasses.replace(requests[0], sampling=SamplingParams(max_tokens=6, temperature=0.9, seed=5))
        assert _run(runner, [sampled])[0].token_ids == _run(runner, [sampled, requests[1]])[0].token_ids


def test_processors_that_take_only_pil_images_and_requests_that_cannot_be_split(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Idefics2: its processor refuses image arrays (so it gets PIL images), and pixel_values of a request with
    two images share one row (so that request runs alone); every answer is HF's."""
    from tests.worker.tiny_others import build_tiny_idefics2

    loaded = load_model(str(build_tiny_idefics2(tmp_path_factory.mktemp("models") / "tiny-idefics2")))
    runner = HFBatchRunner(loaded)
    assert runner.batchable
    requests = _requests(9, seed=31)
    prepared = [runner.prepare(r) for r in requests]
    assert loaded.images_as_pil
    assert [p.encoded is not None for p in prepared] == [len(r.images) > 1 for r in requests]
    results = runner.generate(prepared)
    for req, res in zip(requests, results, strict=True):
        expected, prompt_len = _reference(loaded, req)
        assert res.token_ids == expected and res.prompt_tokens == prompt_len, req.request_id
