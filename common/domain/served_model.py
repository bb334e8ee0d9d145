"""What the API and ingestion know of the served model without loading it: its context length and its tokenizer.

Read from the model's own files (config.json, tokenizer_config.json, tokenizer.json) where this process can
reach them: a local folder, the bundled demo model, or a hub id already in the Hugging Face cache (never
downloaded here). The tokenizer is the `tokenizers` library's, which needs no torch. A model whose files are
not here yet (the worker is still downloading it) is looked for again every RECHECK_SECONDS.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from common.infra.settings import DEMO_MODEL

log = logging.getLogger(__name__)

RECHECK_SECONDS = 60.0
# The bundled demo model's folder (worker/demo/model, as worker.demo names it), found without importing worker code.
DEMO_MODEL_FILES = Path(__file__).resolve().parents[2] / "worker" / "demo" / "model"
# transformers' stand-in for "no limit" (VERY_LARGE_INTEGER) in tokenizer_config.json.
_UNSET_MAX_LENGTH = 10**12


@dataclass(frozen=True)
class ServedModel:
    context_tokens: int | None  # positions the decoder has: prompt and output together
    tokenizer: Any | None  # a tokenizers.Tokenizer, truncation and padding off
    # Tokens one UTF-8 byte of text can become at most: 1 unless a normalizer may grow the text first.
    tokens_per_byte: int = 1

    @property
    def complete(self) -> bool:
        return self.context_tokens is not None and self.tokenizer is not None


_lock = threading.Lock()
_cache: dict[str, tuple[ServedModel, float]] = {}
_complete: dict[str, ServedModel] = {}  # those with every file found: one lookup per request


def served_model(model: str) -> ServedModel:
    """The model's limits, loaded once per model (again after RECHECK_SECONDS while some file was missing)."""
    served = _complete.get(model)
    if served is not None:
        return served
    entry = _cache.get(model)
    if entry is not None and time.monotonic() - entry[1] < RECHECK_SECONDS:
        return entry[0]
    with _lock:
        entry = _cache.get(model)
        if entry is None or not (entry[0].complete or time.monotonic() - entry[1] < RECHECK_SECONDS):
            entry = (_load(model), time.monotonic())
            _cache[model] = entry
            if entry[0].complete:
                _complete[model] = entry[0]
        return entry[0]


def _load(model: str) -> ServedModel:
    config = _read_json(_find(model, "config.json"))
    tokenizer_config = _read_json(_find(model, "tokenizer_config.json"))
    context = _context_tokens(config, tokenizer_config)
    tokenizer, tokens_per_byte = _tokenizer(_find(model, "tokenizer.json"))
    served = ServedModel(context, tokenizer, tokens_per_byte)
    log.info("model %s: context %s tokens, tokenizer %s", model, context or "unknown",
             "loaded" if tokenizer is not None else "not available")
    return served


def _find(model: str, filename: str) -> Path | None:
    """The file of `model` (a folder, the demo model's name or a hub id in the local HF cache), if here."""
    if model == DEMO_MODEL:
        return DEMO_MODEL_FILES / filename
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder / filename
    if model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, filename)
    except Exception as exc:  # not installed, or an id the hub library refuses
        log.debug("no cached %s for %s: %s", filename, model, exc)
        return None
    return Path(found) if isinstance(found, str) else None


def _read_json(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _context_tokens(config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int | None:
    """The decoder's max_position_embeddings (a VLM's text config's, as the worker reads it), else the
    tokenizer's model_max_length."""
    for section in ("text_config", "llm_config", "language_config"):
        sub = config.get(section)
        if isinstance(sub, dict) and _positive_int(sub.get("max_position_embeddings")):
            return int(sub["max_position_embeddings"])
    if _positive_int(config.get("max_position_embeddings")):
        return int(config["max_position_embeddings"])
    length = tokenizer_config.get("model_max_length")
    if _positive_int(length) and length < _UNSET_MAX_LENGTH:
        return int(length)
    return None


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _tokenizer(path: Path | None) -> tuple[Any | None, int]:
    if path is None or not path.is_file():
        return None, 1
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # not installed, or a file this version cannot read
        log.warning("cannot load tokenizer %s: %s", path, exc)
        return None, 1
    tokenizer.no_truncation()
    tokenizer.no_padding()
    normalizer = repr(tokenizer.normalizer) if tokenizer.normalizer is not None else ""
    # Compatibility forms (NFKC, NFKD) turn one character into up to 18; NFC, NFD, lowercasing and the
    # replacements SentencePiece conversions use grow UTF-8 text by less than 4 times.
    tokens_per_byte = 18 if "NFK" in normalizer else 4 if normalizer else 1
    return tokenizer, tokens_per_byte


def forget() -> None:
    """Drop every cached model (tests)."""
    with _lock:
        _cache.clear()
        _complete.clear()
