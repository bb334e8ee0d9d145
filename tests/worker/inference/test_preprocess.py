"""worker/inference/preprocess.py: a prompt without images skips the processor only where the processor would have
returned exactly the tokenizer's output, for every family and every kind of text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from worker.inference.generation import GenerationRequest, InputError
from worker.inference.model_loader import LoadedModel, load_model, text_alone_by_tokenizer
from worker.inference.preprocess import encode_prompt

TEXTS = [
    "tell me a story about the red house",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tindented",
    "Café naïve 東京 Ωμέγα — emoji 🙂 and digits 0123456789",
    "many words " * 40,
]


@pytest.fixture(scope="module", params=["llava", "llava_siglip", "qwen2_vl", "internvl"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    fixture = {"llava": "tiny_llava_path", "llava_siglip": "tiny_llava_siglip_path",
               "qwen2_vl": "tiny_qwen2_vl_path", "internvl": "tiny_internvl_path"}[request.param]
    path: Path = request.getfixturevalue(fixture)
    return load_model(str(path), weights=False)


def _request(messages: list[dict[str, Any]], images: list[Image.Image] | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="r", messages=messages, images=images or [])


def _by_processor(loaded: LoadedModel, req: GenerationRequest) -> Any:
    prompt = loaded.processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    return loaded.processor(text=[prompt], images=req.images or None, return_tensors="pt")


def test_text_prompts_tokenize_exactly_as_through_the_processor(loaded: LoadedModel) -> None:
    # Qwen2-VL's processor adds mm_token_type_ids (zeros) to every prompt, so it keeps the processor path.
    assert loaded.text_by_tokenizer == (loaded.model.config.model_type != "qwen2_vl")
    conversations = [[{"role": "user", "content": [{"type": "text", "text": text}]}] for text in TEXTS]
    conversations.append([
        {"role": "system", "content": [{"type": "text", "text": "You label images. Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": " second"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ])
    for messages in conversations:
        req = _request(messages)
        encoded = encode_prompt(loaded, req)
        want = _by_processor(loaded, req)
        assert torch.equal(encoded.input_ids, want["input_ids"][0].to(torch.long)), messages
        assert set(encoded.encoded.keys()) == set(want.keys())
        assert encoded.num_images == 0


def test_image_prompts_still_go_through_the_processor(loaded: LoadedModel) -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    req = _request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
                   [image])
    encoded = encode_prompt(loaded, req)
    want = _by_processor(loaded, req)
    assert torch.equal(encoded.input_ids, want["input_ids"][0].to(torch.long))
    assert torch.equal(encoded.encoded["pixel_values"], want["pixel_values"])
    assert encoded.num_images == 1 and encoded.prompt_tokens > len(loaded.tokenizer("what is it?")["input_ids"])


class _Prefixing:
    """A processor that changes text-only prompts (some families add a prefix or normalise text)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.apply_chat_template(*args, **kwargs)

    def __call__(self, text: list[str], images: Any = None, **kwargs: Any) -> Any:
        return self.inner(text=["<prefix>" + t for t in text], images=images, **kwargs)


class _NeedsImages(_Prefixing):
    def __call__(self, text: list[str], images: Any = None, **kwargs: Any) -> Any:
        if images is None:
            raise ValueError("this processor wants images")
        return self.inner(text=text, images=images, **kwargs)


def test_a_processor_that_changes_text_keeps_the_processor_path(loaded: LoadedModel) -> None:
    changed = _Prefixing(loaded.processor)
    assert not text_alone_by_tokenizer(changed, loaded.tokenizer)
    assert not text_alone_by_tokenizer(_NeedsImages(loaded.processor), loaded.tokenizer)
    as_loaded = LoadedModel(model=loaded.model, processor=changed, tokenizer=loaded.tokenizer,
                            image_token_id=loaded.image_token_id,
                            text_by_tokenizer=text_alone_by_tokenizer(changed, loaded.tokenizer))
    req = _request([{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    assert torch.equal(encode_prompt(as_loaded, req).input_ids, _by_processor(as_loaded, req)["input_ids"][0])


def test_text_path_keeps_the_checks(loaded: LoadedModel) -> None:
    placeholder = getattr(loaded.processor, "image_token", None) or loaded.tokenizer.convert_ids_to_tokens(
        loaded.image_token_id)
    typed = _request([{"role": "user", "content": [{"type": "text", "text": f"look: {placeholder}"}]}])
    with pytest.raises(InputError, match="image placeholder"):
        encode_prompt(loaded, typed)
