"""Hostile batch input lines: each one a line of the batch's error file, every other line unaffected.

Postgres and the S3 server as in test_ingest.py (whose helpers this reuses); no model, no broker."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import pytest

from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import settings_from_env
from tests.worker.batches.test_ingest import (
    MODEL,
    Recorder,
    _finish,
    _read_jsonl,
    batch_jobs,
    get_batch,
    line,
    make_batch,
)
from worker.batches.finalize import finalize_batch
from worker.batches.ingest import IngestDeps, ingest_batch


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", ingest_chunk_rows=4, max_body_bytes=64 * 1024)


def _bomb_png(side: int = 20_000) -> bytes:
    """A valid 1-bit PNG of side x side pixels (400 MP by default) in a few tens of KB."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = zlib.compress((b"\0" * (1 + side // 8)) * side, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def _raw(custom_id: Any, body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _image_line(custom_id: str, url: Any) -> str:
    return _raw(custom_id, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}], "max_tokens": 2})


def test_each_hostile_line_is_one_error_line(settings: Settings, db: Database, store: ObjectStore) -> None:
    red = png_bytes((220, 10, 10), (5, 5))
    hostile: list[tuple[bytes, str | None, str]] = [  # (line, custom_id the error names, code)
        (b"x" * (settings.max_body_bytes + 10), None, "line_too_long"),
        (b'{"custom_id": "utf", "body": "\xff\xfe"}', None, "invalid_utf8"),
        (b'{"custom_id": "trunc", "body": {', None, "invalid_json"),
        (b"[" * 60_000, None, "invalid_json"),  # nesting deeper than the parser's stack
        (b'{"custom_id": "big", "seed": ' + b"9" * 5000 + b"}", None, "invalid_json"),  # past int's digit limit
        (b'"just a string"', None, "invalid_line"),
        (_raw(7, {}).encode(), None, "missing_custom_id"),
        (_raw("list-body", [1, 2]).encode(), "list-body", "invalid_request"),
        (_raw("str-messages", {"messages": "hi"}).encode(), "str-messages", "invalid_request"),
        (_raw("bad-tokens", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(),
         "bad-tokens", "invalid_request"),
        (_image_line("url-int", 42).encode(), "url-int", "invalid_request"),
        (_image_line("missing-image", "img_" + "0" * 64).encode(), "missing-image", "unknown_image"),
        (_image_line("not-an-image", data_url(b"hello")).encode(), "not-an-image", "invalid_image"),
        (_image_line("bomb", data_url(_bomb_png())).encode(), "bomb", "invalid_image"),
        (_image_line("remote", "https://example.com/cat.png").encode(), "remote", "image_url_not_allowed"),
        (_image_line("relative", "cat.png").encode(), "relative", "invalid_image"),
        # SQL text cannot hold NUL: refused as a custom_id (the error cannot name it), carried in a prompt.
        (_raw("nul\u0000id", {"messages": [{"role": "user", "content": "x"}]}).encode(), None, "invalid_custom_id"),
        # JSON can spell what neither SQL nor a UTF-8 output line can hold: lone surrogates, NaN, infinity.
        (_raw("sur\udc00id", {"messages": [{"role": "user", "content": "x"}]}).encode(), None, "invalid_custom_id"),
        (_raw("sur-prompt", {"messages": [{"role": "user", "content": "x\ud800"}]}).encode(), "sur-prompt",
         "invalid_request"),
        (json.dumps({"custom_id": "sur-url", "url": "/v1/\udfff", "body": {}}).encode(), "sur-url", "invalid_request"),
        (b'{"custom_id": "nan", "body": {"messages": [{"role": "user", "content": "x"}], "temperature": NaN}}',
         "nan", "invalid_request"),
        (b'{"custom_id": "inf", "body": {"messages": [{"role": "user", "content": "x"}], "top_p": 1e999}}',
         "inf", "invalid_request"),
        (_raw("big-seed", {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}).encode(), "big-seed",
         "invalid_request"),
    ]
    good = [line("first", image=red).encode(), line("second", text="a\u0000b").encode(),
            line("last", image=red).encode()]
    # A UTF-8 BOM before the first line (Windows editors write one) is not part of it.
    lines = [b"\xef\xbb\xbf" + good[0], *[h[0] for h in hostile[:8]], good[1], *[h[0] for h in hostile[8:]], good[2]]
    batch_id = make_batch(db, store, b"\r\n".join(lines) + b"\n")

    assert ingest_batch(batch_id, IngestDeps(settings, db, store, Recorder())) == "in_progress"
    created = {j.custom_id: j for j in batch_jobs(db, batch_id)}
    assert set(created) == {"first", "second", "last"}
    assert created["second"].request["messages"][0]["content"][0]["text"] == "a\x00b"
    for job in created.values():
        _finish(db, store, job, f"answer\x00 {job.custom_id}")  # a model can generate NUL too
    assert finalize_batch(batch_id, db, store) == "completed"

    batch = get_batch(db, batch_id)
    assert (batch.total_requests, batch.refused_requests) == (len(lines), len(hostile))
    output = _read_jsonl(store, db, batch.output_file_id or "")
    assert sorted((o["custom_id"], o["response"]["body"]["choices"][0]["message"]["content"]) for o in output) == [
        ("first", "answer\x00 first"), ("last", "answer\x00 last"), ("second", "answer\x00 second")]
    errors = _read_jsonl(store, db, batch.error_file_id or "")
    assert sorted((e["custom_id"] or "", e["error"]["code"]) for e in errors) == sorted(
        (cid or "", code) for _, cid, code in hostile)
    assert all(e["response"] is None and e["error"]["message"] for e in errors)
    messages = {e["error"]["code"]: e["error"]["message"] for e in errors}
    assert "too large" in next(e["error"]["message"] for e in errors if e["custom_id"] == "bomb")
    assert f"longer than the limit of {settings.max_body_bytes} bytes" in messages["line_too_long"]
    assert len(json.dumps(errors)) < 20_000  # no error echoes a huge line back
