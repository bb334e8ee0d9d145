"""Prompts measured against the served model's context at submission (common/domain/prompt_size.py), with the bundled
demo model's own files (a 256-token context) and no model loaded."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.domain import served_model
from common.domain.prompt_size import _least_tokens, check_prompt_size
from common.domain.schemas import JobCreate
from common.domain.submission_error import SubmissionError
from common.infra.settings import DEMO_MODEL, Settings
from worker.demo import DEMO_MODEL_DIR

CONTEXT = 256  # the demo model's max_position_embeddings


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    served_model.forget()
    yield
    served_model.forget()


def request(*contents: Any) -> JobCreate:
    return JobCreate.model_validate({"messages": [{"role": "user", "content": c} for c in contents]})


def refusal(req: JobCreate, settings: Settings, model: str | None = DEMO_MODEL) -> SubmissionError | None:
    try:
        check_prompt_size(req, settings, model)
    except SubmissionError as exc:
        return exc
    return None


def test_a_prompt_longer_than_the_context_is_refused_and_a_short_one_is_not() -> None:
    settings = Settings()
    assert refusal(request("What colour is the star?"), settings) is None
    assert refusal(request("the star " * 20), settings) is None
    exc = refusal(request("the star " * 400), settings)
    assert exc is not None and exc.status_code == 400 and exc.code == "context_length_exceeded"
    assert exc.param == "messages" and f"at most {CONTEXT - 1} prompt tokens" in str(exc)
    # Spread over many messages and parts, and a million characters in one part, alike.
    assert refusal(request(*["the star is red and the circle is blue"] * 60), settings) is not None
    parts = [{"type": "text", "text": "the square is left of the red circle "}] * 60
    assert refusal(request(parts), settings) is not None
    assert refusal(request("x" * 1_000_000), settings) is not None


def test_the_plain_caps_hold_where_the_model_is_unknown() -> None:
    settings = Settings(max_job_messages=100, max_job_text_chars=5000)
    # The 4 MB job of 100,000 messages, for a model whose files this process cannot read.
    exc = refusal(request(*["hello there, how are you?"] * 100_000), settings, model=None)
    assert exc is not None and exc.code == "too_many_messages" and exc.param == "messages"
    assert "100,000" in str(exc) and "100" in str(exc)
    parts = [{"type": "text", "text": ""}] * 101  # content parts count, empty or not
    assert refusal(request(parts), settings, model=None).code == "too_many_messages"  # type: ignore[union-attr]
    exc = refusal(request("a" * 5001), settings, model=None)
    assert exc is not None and exc.code == "text_too_long" and "5,001" in str(exc)
    assert refusal(request("a" * 5000), settings, model=None) is None
    assert refusal(request(*["hi"] * 100), settings, model=None) is None
    assert Settings().max_job_messages < 100_000  # the defaults refuse that job too


def _random_text(rng: random.Random) -> str:
    words = ["the", "star", "circle", "square", "red", "blue", "left", "of", "is", "what", "colour", "shapes",
             "ünïcödé", "漢字", "🙂", "<image>", "\n", "  ", ",", "?", "123", "xyzzy"]
    return ("" if rng.random() < 0.5 else " ") + "".join(
        rng.choice(words) + rng.choice(["", " ", " ", "  ", "\n"]) for _ in range(rng.randint(0, 60)))


def test_the_count_never_exceeds_the_prompt_the_worker_tokenizes() -> None:
    """Nothing that fits is refused: over random prompts (parts split mid-word, joined without spaces by the
    template, Unicode, whitespace), the lower bound stays at or under the real prompt's tokens."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(DEMO_MODEL_DIR)
    served = served_model.served_model(DEMO_MODEL)
    assert served.context_tokens == CONTEXT and served.tokenizer is not None
    assert DEMO_MODEL_DIR.resolve() == served_model.DEMO_MODEL_FILES
    rng = random.Random(7)
    closest = 0.0
    for _ in range(300):
        messages: list[dict[str, Any]] = []
        texts: list[str] = []
        for _ in range(rng.randint(1, 4)):
            role = rng.choice(["system", "user", "assistant"])
            if rng.random() < 0.5:
                text = _random_text(rng)
                messages.append({"role": role, "content": text})
                texts.append(text)
            else:
                parts = [_random_text(rng) for _ in range(rng.randint(1, 4))]
                messages.append({"role": role, "content": [{"type": "text", "text": p} for p in parts]})
                texts += parts
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        real = len(processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        least = _least_tokens(served, texts, 0, 10**9)
        assert least <= real, (least, real, messages)
        closest = max(closest, least / real)
    assert closest > 0.8  # and it is a bound worth having


def test_a_hub_id_is_read_from_the_hf_cache_once_its_files_are_there(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    settings = Settings(model="acme/vlm-7b")
    long = request("the star " * 400)
    assert refusal(long, settings, "acme/vlm-7b") is None  # not downloaded yet: the caps only
    snapshot = tmp_path / "models--acme--vlm-7b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--acme--vlm-7b" / "refs").mkdir()
    (tmp_path / "models--acme--vlm-7b" / "refs" / "main").write_text("abc123")
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 128
    (snapshot / "config.json").write_text(json.dumps(config))
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", snapshot / "tokenizer.json")
    assert refusal(long, settings, "acme/vlm-7b") is None  # looked for again only after a while
    monkeypatch.setattr(served_model, "RECHECK_SECONDS", 0.0)
    exc = refusal(long, settings, "acme/vlm-7b")
    assert exc is not None and "context of 128 tokens" in str(exc) and "'vlm-7b'" in str(exc)


def test_the_tokenizers_model_max_length_stands_in_for_a_config_without_positions(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "something"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    assert served_model.served_model(str(tmp_path)).context_tokens == 64
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10**30}))  # "no limit"
    served_model.forget()
    assert served_model.served_model(str(tmp_path)).context_tokens is None
    assert refusal(request("the star " * 400), Settings(), str(tmp_path)) is None
