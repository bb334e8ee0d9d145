"""Each family adapter against the HF model it wraps: cross-request vision batches, per-image placeholders,
positions (M-RoPE included), a forward and a greedy decode driven through the bare decoder, and packing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.tiny_families import main as tiny_model_main
from worker.engine.families import ModelFamily, get_family
from worker.inference.model_loader import LoadedModel, load_model

FAMILIES = ["llava", "llava_siglip", "qwen2_vl", "qwen2_5_vl", "internvl"]


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Content orders: images first (LLaVA renders two as one "<image><image>" run), text around them, text only.
CASES: dict[str, list[Any]] = {
    "text": ["tell me a story about the red house"],
    "one_image": [_image(40, 90, 1), "describe the picture"],
    "two_images": [_image(64, 64, 2), _image(100, 30, 3), "what is left and right"],
    "interleaved": ["first", _image(33, 120, 4), "then", _image(24, 24, 5), "compare them"],
}


@pytest.fixture(scope="module")
def models(
    tiny_llava_path: Path, tiny_llava_siglip_path: Path, tiny_qwen2_vl_path: Path, tiny_qwen2_5_vl_path: Path,
    tiny_internvl_path: Path,
) -> Callable[[str], LoadedModel]:
    """Loads lazily through the production loader, so one family failing to load fails only its own tests."""
    paths = {"llava": tiny_llava_path, "llava_siglip": tiny_llava_siglip_path, "qwen2_vl": tiny_qwen2_vl_path,
             "qwen2_5_vl": tiny_qwen2_5_vl_path, "internvl": tiny_internvl_path}
    cache: dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in cache:
            cache[name] = load_model(str(paths[name]))
        return cache[name]

    return get


def _encode(loaded: LoadedModel, parts: list[Any]) -> Any:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    prompt = loaded.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [p for p in parts if not isinstance(p, str)]
    return loaded.processor(text=[prompt], images=images or None, return_tensors="pt")


def _num_images(parts: list[Any]) -> int:
    return sum(not isinstance(p, str) for p in parts)


def _prompt_embeds(loaded: LoadedModel, family: ModelFamily, enc: Any, num_images: int) -> torch.Tensor:
    """Token embeddings with each image's encoder rows written at its placeholder span, as the engine does."""
    ids = enc["input_ids"][0]
    embeds = family.embed_tokens(loaded.model)(ids)
    features = family.encode_images(loaded.model, family.image_inputs(enc, num_images))
    for (offset, n), rows in zip(family.image_spans(ids, num_images), features, strict=True):
        assert rows.shape[0] == n
        embeds[offset : offset + n] = rows
    return embeds


def _decoder_logits(loaded: LoadedModel, family: ModelFamily, enc: Any, prompt_embeds: torch.Tensor,
                    generated: list[int]) -> torch.Tensor:
    """Logits of prompt + generated tokens through the bare decoder, one unpacked sequence, default attention."""
    model = loaded.model
    embeds = prompt_embeds
    if generated:
        embeds = torch.cat([embeds, family.embed_tokens(model)(torch.tensor(generated))])
    positions, delta = family.prompt_positions(enc["input_ids"][0], enc)
    seq = family.sequence_positions(positions, delta, 0, embeds.shape[0])
    hidden = family.language_model(model)(
        inputs_embeds=embeds.unsqueeze(0), position_ids=family.packed_position_ids([seq]), attention_mask=None,
        use_cache=False,
    ).last_hidden_state
    return family.lm_head(model)(hidden)[0]


def _hf_scattered(loaded: LoadedModel, enc: Any) -> torch.Tensor:
    """inputs_embeds as HF's own forward builds them for this request alone (get_image_features + masked_scatter)."""
    model = loaded.model
    kwargs = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    pooled = model.get_image_features(**kwargs, return_dict=True).pooler_output
    flat = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    ids = enc["input_ids"][0]
    return model.get_input_embeddings()(ids).masked_scatter((ids == loaded.image_token_id)[:, None], flat)


@pytest.mark.parametrize("name", FAMILIES)
def test_encode_images_is_one_vision_forward_across_requests(
    name: str, models: Callable[[str], LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = models(name)
    family = get_family(loaded.model)
    requests = [CASES["one_image"], CASES["two_images"], CASES["interleaved"]]
    encs = [_encode(loaded, parts) for parts in requests]
    inputs = [inp for enc, parts in zip(encs, requests, strict=True)
              for inp in family.image_inputs(enc, _num_images(parts))]
    forwards = []
    real = loaded.model.get_image_features
    monkeypatch.setattr(loaded.model, "get_image_features", lambda **kw: forwards.append(kw) or real(**kw))  # type: ignore[func-returns-value]
    with torch.inference_mode():
        batched = family.encode_images(loaded.model, inputs)
        monkeypatch.undo()
        expected = []
        for enc, parts in zip(encs, requests, strict=True):
            scattered = _hf_scattered(loaded, enc)
            expected += [scattered[o : o + n] for o, n in family.image_spans(enc["input_ids"][0], _num_images(parts))]
    # Every tiny tower takes all these images in one batch (same tile size / patch width).
    assert len(forwards) == 1
    assert len(batched) == len(expected) == 5
    for got, want in zip(batched, expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if name in ("qwen2_vl", "internvl"):  # their images of different shapes take different numbers of tokens
        assert len({t.shape[0] for t in batched}) > 1


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_decoder_forward_matches_hf_forward(name: str, case: str, models: Callable[[str], LoadedModel]) -> None:
    loaded = models(name)
    family = get_family(loaded.model)
    enc = _encode(loaded, CASES[case])
    with torch.inference_mode():
        want = loaded.model(**enc).logits[0]
        got = _decoder_logits(loaded, family, enc, _prompt_embeds(loaded, family, enc, _num_images(CASES[case])), [])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_decode_matches_generate(name: str, case: str, models: Callable[[str], LoadedModel]) -> None:
    loaded = models(name)
    family = get_family(loaded.model)
    enc = _encode(loaded, CASES[case])
    prompt_len = enc["input_ids"].shape[1]
    with torch.inference_mode():
        want = loaded.model.generate(
            **enc, max_new_tokens=8, do_sample=False, eos_token_id=loaded.eos_token_ids,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )[0, prompt_len:].tolist()
        prompt_embeds = _prompt_embeds(loaded, family, enc, _num_images(CASES[case]))
        got: list[int] = []
        while len(got) < 8 and not (got and got[-1] in loaded.eos_token_ids):
            logits = _decoder_logits(loaded, family, enc, prompt_embeds, got)[-1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4  # the tiny model's greedy picks are not float-noise coin flips
            got.append(int(logits.argmax()))
    assert got == want
    assert len(set(want)) > 1


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_prefill_matches_separate_sequences(name: str, models: Callable[[str], LoadedModel]) -> None:
    loaded = models(name)
    family = get_family(loaded.model)
    lm = family.language_model(loaded.model)
    seqs = []
    with torch.inference_mode():
        for parts in (CASES["one_image"], CASES["text"], CASES["interleaved"]):
            enc = _encode(loaded, parts)
            embeds = _prompt_embeds(loaded, family, enc, _num_images(parts))
            positions, delta = family.prompt_positions(enc["input_ids"][0], enc)
            seqs.append((embeds, family.sequence_positions(positions, delta, 0, embeds.shape[0])))
        alone = [lm(inputs_embeds=e[None], position_ids=family.packed_position_ids([p]), use_cache=False)
                 .last_hidden_state[0] for e, p in seqs]
        embeds = torch.cat([e for e, _ in seqs])[None]
        position_ids = family.packed_position_ids([p for _, p in seqs])
        packed = lm(inputs_embeds=embeds, position_ids=position_ids, use_cache=False).last_hidden_state[0]
        torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
        if name == "qwen2_vl":
            # Without the text row Qwen2VLTextModel builds one causal mask over the whole pack: the later
            # sequences then attend to the earlier ones (docs/architecture.md).
            assert position_ids.shape == (4, 1, embeds.shape[1])
            leaky = lm(inputs_embeds=embeds, position_ids=position_ids[1:], use_cache=False).last_hidden_state[0]
            first = seqs[0][0].shape[0]
            torch.testing.assert_close(leaky[:first], alone[0], atol=1e-5, rtol=0)
            assert not torch.allclose(leaky[first:], torch.cat(alone[1:]), atol=1e-3)


def test_qwen2_vl_prompt_positions_match_get_rope_index(models: Callable[[str], LoadedModel]) -> None:
    loaded = models("qwen2_vl")
    family = get_family(loaded.model)
    processor = loaded.processor
    encs = [_encode(loaded, parts) for parts in CASES.values()]
    # A prompt that ends on an image's placeholders, so the delta comes from the image, not trailing text.
    encs.append(processor(text=["look <|image_pad|>"], images=[_image(120, 40, 6)], return_tensors="pt"))
    for enc in encs:
        ids = enc["input_ids"]
        want, want_delta = loaded.model.model.get_rope_index(
            ids, mm_token_type_ids=enc["mm_token_type_ids"], image_grid_thw=enc.get("image_grid_thw")
        )
        got, delta = family.prompt_positions(ids[0].tolist(), enc.get("image_grid_thw"))
        assert got is not None
        assert torch.equal(got, want[:, 0]), (got, want[:, 0])
        assert delta == int(want_delta)
        n = ids.shape[1]
        # Chunked prefill and decode: chunk positions concatenate to the whole, decode is index + delta.
        whole = family.sequence_positions(got, delta, 0, n + 3)
        chunks = [family.sequence_positions(got, delta, s, e - s) for s, e in ((0, 5), (5, n - 1), (n - 1, n + 3))]
        assert torch.equal(torch.cat(chunks, dim=1), whole)
        assert torch.equal(whole[0], torch.arange(n + 3))
        assert torch.equal(whole[1:, :n], got)
        assert torch.equal(whole[1:, n:], (torch.arange(n, n + 3) + delta).expand(3, -1))
        # A packed step of a chunk, a decode and a fresh prompt: the batch form is the per-sequence one.
        spans = [(got, delta, 5, n - 6), (got, delta, n + 2, 1), (got, delta, 0, n)]
        assert torch.equal(family.batch_position_ids(spans),
                           family.packed_position_ids([family.sequence_positions(*span) for span in spans]))


def test_one_d_families_position_layout(models: Callable[[str], LoadedModel]) -> None:
    family = get_family(models("llava").model)
    assert family.prompt_positions([1, 2, 3]) == (None, 0)
    packed = family.packed_position_ids([family.sequence_positions(None, 0, 0, 3),
                                         family.sequence_positions(None, 0, 7, 1)])
    assert packed.tolist() == [[0, 1, 2, 7]]
    # The vectorised batch form: prefills, chunks and decodes of any lengths, in packed order.
    spans = [(None, 0, 0, 3), (None, 0, 7, 1), (None, 0, 40, 5), (None, 0, 0, 1), (None, 0, 2, 1)]
    assert family.batch_position_ids(spans).tolist() == [[0, 1, 2, 7, 40, 41, 42, 43, 44, 0, 2]]
    assert torch.equal(family.batch_position_ids(spans),
                       family.packed_position_ids([family.sequence_positions(*span) for span in spans]))


@pytest.mark.parametrize("name", ["qwen2_vl", "internvl"])
def test_hf_generate_on_images_of_many_sizes(name: str, models: Callable[[str], LoadedModel]) -> None:
    """HF's own generate runs on the tiny checkpoints, alone and batched, and images shape the output."""
    loaded = models(name)
    family = get_family(loaded.model)
    sizes = [(24, 24), (120, 40), (40, 120), (97, 33), (64, 64), (200, 150)]
    requests = [[_image(w, h, 10 + i), "describe the picture"] for i, (w, h) in enumerate(sizes)]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": loaded.eos_token_ids,
              "pad_token_id": loaded.tokenizer.pad_token_id}
    alone, counts = [], []
    with torch.inference_mode():
        for parts in requests:
            enc = _encode(loaded, parts)
            (_, n), = family.image_spans(enc["input_ids"][0], 1)
            if name == "qwen2_vl":
                assert n == int(enc["image_grid_thw"][0].prod()) // 4
            else:
                assert n == enc["pixel_values"].shape[0] * loaded.model.config.image_seq_length
            counts.append(n)
            alone.append(loaded.model.generate(**enc, **kwargs)[0, enc["input_ids"].shape[1] :].tolist())
        prompts = [loaded.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": parts[1]}]}],
            add_generation_prompt=True, tokenize=False) for parts in requests]
        batch = loaded.processor(text=prompts, images=[parts[0] for parts in requests], padding=True,
                                 return_tensors="pt")
        batched = loaded.model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1] :].tolist()
    assert len(set(counts)) > 2
    assert len({tuple(out) for out in alone}) > 2
    for solo, row in zip(alone, batched, strict=True):
        assert row[: len(solo)] == solo


@pytest.mark.parametrize(("cli_family", "fixture"), [("qwen2-vl", "tiny_qwen2_vl_path"),
                                                     ("internvl", "tiny_internvl_path")])
def test_tiny_model_cli_is_deterministic_and_small(
    cli_family: str, fixture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    reference: Path = request.getfixturevalue(fixture)
    assert tiny_model_main([str(tmp_path / "m"), "--family", cli_family]) == 0
    for path in reference.iterdir():
        assert (tmp_path / "m" / path.name).read_bytes() == path.read_bytes(), path.name
    assert sum(p.stat().st_size for p in reference.iterdir()) < 4 << 20


def test_internvl_processor_reloads_with_its_image_seq_length(models: Callable[[str], LoadedModel]) -> None:
    loaded = models("internvl")
    # ProcessorMixin.from_args_and_dict keeps only kwargs named in `cls.__init__.__code__`, so an image-only
    # subclass must not override __init__ (drop "video_processor" from get_attributes instead), or InternVL
    # reloads with the default 256 tokens per tile.
    assert loaded.processor.image_seq_length == loaded.model.config.image_seq_length == 4


def test_get_family_rejects_unknown_models() -> None:
    fake = SimpleNamespace(config=SimpleNamespace(model_type="gemma3", image_token_id=7))
    with pytest.raises(ValueError, match="gemma3"):
        get_family(fake)
