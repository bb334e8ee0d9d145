"""POST /v1/jobs refuses at submission what cannot fit the served model, over real HTTP (no worker): the
served model's files are readable by the API (the demo model's config and tokenizer, a 256-token context)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from common.domain import served_model
from tests.conftest import ApiServer, settings_from_env
from worker.demo import DEMO_MODEL_DIR

MODEL = "bounded-model"


@pytest.fixture(scope="module")
def api(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    folder = tmp_path_factory.mktemp("models") / MODEL
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_MODEL_DIR / name).read_bytes())
    served_model.forget()
    settings = settings_from_env(service_env, model=str(folder))
    with ApiServer(settings) as server, server.client(timeout=60) as client:
        yield client


def body(*texts: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": t} for t in texts], **extra}


def test_a_prompt_over_the_context_is_a_400_naming_the_limit(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", json=body("the star " * 400))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "context of 256 tokens" in error["message"] and "at most 255 prompt tokens" in error["message"]
    # One that fits is accepted, and max_tokens past the room left is not an error: the worker stops there.
    accepted = api.post("/v1/jobs", json=body("What colour is the star?", max_tokens=4096))
    assert accepted.status_code == 202, accepted.text


def test_the_job_of_a_hundred_thousand_messages_is_refused(api: httpx.Client) -> None:
    raw = json.dumps(body(*["What colour is the star? Tell me please."] * 100_000)).encode()
    assert len(raw) > 4_000_000
    response = api.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "too_many_messages" and error["param"] == "messages" and "1,024" in error["message"]


def test_many_short_messages_that_fit_the_caps_but_not_the_context(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", json=body(*["the star is red and the circle is blue"] * 200))
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_a_multipart_job_is_measured_too(api: httpx.Client) -> None:
    response = api.post("/v1/jobs", data={"prompt": "the star " * 400})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
