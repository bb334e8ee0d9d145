"""POST /v1/chat/completions through the official `openai` client on the real stack: the API, an ingest worker
and a model worker running the tiny LLaVA. A chat completion is the same job a Batch API line makes, so it
must give the same answer; a client that goes away leaves a job that ends all the same."""

from __future__ import annotations

import io
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.api.test_jobs_api import data_url, png_bytes
from tests.api.test_openai_batch import Stack, _raw, request_line, running_stack
from tests.hf_reference import hf_messages, hf_reference_answer
from tests.log_records import LogRecords
from tests.test_end_to_end import make_jobs
from worker.inference.model_loader import load_model


@pytest.fixture(scope="module")
def stack(service_env: dict[str, str], tiny_llava_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    with running_stack(service_env, tiny_llava_path, tmp_path_factory.mktemp("chat-logs")) as running:
        yield running


def _near_tie(tiny_llava_path: Path, body: dict[str, Any]) -> bool:
    """Whether HF's own greedy decoding of `body` met a float-noise tie (tests/hf_reference.py)."""
    images = [Image.open(io.BytesIO(_raw(p["image_url"]["url"]))).convert("RGB")
              for m in body["messages"] if isinstance(m["content"], list)
              for p in m["content"] if p["type"] == "image_url"]
    return hf_reference_answer(load_model(str(tiny_llava_path)), hf_messages(body["messages"]), images,
                               body["max_tokens"])[3]


def test_chat_completions_answer_as_the_same_lines_of_a_batch(stack: Stack, tiny_llava_path: Path) -> None:
    png = [{"role": "user", "content": [
        {"type": "text", "text": "What colour is the square?"},
        {"type": "image_url", "image_url": {"url": data_url(png_bytes((30, 200, 40), (48, 32)))}}]}]
    bodies = [{"messages": png, "max_tokens": 12}, *make_jobs(4, seed=23)]
    model = stack.settings.served_model_name
    # The first may wait for the worker to load the model (and build its kernels).
    client = stack.client.with_options(timeout=300)
    chats = [client.chat.completions.create(model=model, **body) for body in bodies]

    batch = stack.wait(stack.run([request_line(f"r{i}", b) for i, b in enumerate(bodies)]).id)
    assert batch.status == "completed", batch
    lines = {line["custom_id"]: line["response"]["body"] for line in stack.jsonl(batch.output_file_id)}
    for i, (body, chat) in enumerate(zip(bodies, chats, strict=True)):
        line = lines[f"r{i}"]
        assert chat.object == "chat.completion" and chat.model == model == line["model"]
        assert chat.usage is not None and chat.usage.prompt_tokens == line["usage"]["prompt_tokens"]
        got, batched = chat.choices[0], line["choices"][0]
        if got.message.content != batched["message"]["content"]:
            # Greedy decoding is the same computation either way, bar a tie that float noise decides.
            assert _near_tie(tiny_llava_path, body), (i, got.message.content, batched["message"]["content"])
            continue
        assert got.finish_reason == batched["finish_reason"]
        assert chat.usage.completion_tokens == line["usage"]["completion_tokens"]
    job = stack.http.get(f"/v1/jobs/{chats[0].id.removeprefix('chatcmpl-')}").json()
    assert job["status"] == "succeeded" and job["priority"] == 9


def test_a_client_that_goes_away_leaves_a_job_that_ends(stack: Stack) -> None:
    """The worker is paused so that the job cannot end before the client gives up; the API notices the closed
    connection, logs it without a traceback, and the job runs once the worker is back."""
    key = stack.server.make_key(f"leaves-{uuid.uuid4().hex[:6]}")  # a tenant of its own: its one job is this
    records = LogRecords()
    # uvicorn's own loggers do not propagate: an error in the ASGI app would be logged on uvicorn.error.
    watched = [logging.getLogger(), logging.getLogger("uvicorn.error")]
    root_level = logging.getLogger().level
    for logger in watched:
        logger.addHandler(records)
    logging.getLogger().setLevel(logging.INFO)
    body = {"model": stack.settings.served_model_name, "max_tokens": 6,
            "messages": [{"role": "user", "content": "goodbye"}]}
    os.kill(stack.model_pid, signal.SIGSTOP)
    try:
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"},
                          timeout=httpx.Timeout(30, read=1.0)) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body)
        deadline = time.monotonic() + 10
        while not any("client went away" in r.getMessage() for r in records.records):
            assert time.monotonic() < deadline, "the API did not notice the client leave"
            time.sleep(0.05)
        with stack.server.client(api_key=key) as http:
            listed = http.get("/v1/jobs").json()["data"]
        assert [j["status"] for j in listed] == ["queued"]
    finally:
        os.kill(stack.model_pid, signal.SIGCONT)
        for logger in watched:
            logger.removeHandler(records)
        logging.getLogger().setLevel(root_level)
    job_id = listed[0]["id"]
    with stack.server.client(api_key=key) as http:
        deadline = time.monotonic() + 120
        while (job := http.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["status"] == "succeeded", job
        assert http.get(f"/v1/jobs/{job_id}/result").json()["choices"][0]["message"]["content"] == (
            job["result"]["text"])
    assert not records.errors(), [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]
