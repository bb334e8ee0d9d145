"""GET /v1/models and POST /v1/chat/completions over real HTTP on Postgres, Redis and the S3 server, with no
worker: a chat completion's job stays queued unless the test ends it in SQL, as a worker would, or cancels it.
(tests/api/test_chat_completions.py runs them against a real worker.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy import event, select, update

from common.domain.models import Job, JobStatus
from common.infra.settings import Settings
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import ApiServer, settings_from_env

MODEL = "tiny-chat"
WAIT_S = 1.5


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", chat_wait_seconds=WAIT_S)


@pytest.fixture(scope="module")
def server(settings: Settings) -> Iterator[ApiServer]:
    with ApiServer(settings) as api:
        yield api


@pytest.fixture(scope="module")
def client(server: ApiServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=30)


def messages(text: str = "What colour is it?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]}]


def job_with_key(server: ApiServer, key: str, timeout: float = 10) -> str:
    """The id of the job a request with this Idempotency-Key made, once it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with server.app.state.vlmq.db.session() as session:
            job_id = session.scalar(select(Job.id).where(Job.idempotency_key == key))
        if job_id is not None:
            return job_id
        time.sleep(0.02)
    raise TimeoutError(f"no job with Idempotency-Key {key}")


def end_job(server: ApiServer, job_id: str, **values: Any) -> None:
    with server.app.state.vlmq.db.session() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def test_models_list_and_retrieve_through_the_openai_client(client: OpenAI, server: ApiServer) -> None:
    listed = client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [(MODEL, "model", "vlmq")]
    assert abs(listed.data[0].created - time.time()) < 3600
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.created == listed.data[0].created
    for unknown in ("gpt-4o", "org/tiny-chat"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.models.retrieve(unknown)
        assert refused.value.code == "model_not_found" and unknown in refused.value.message
    with httpx.Client(base_url=server.url) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get(f"/v1/models/{MODEL}").status_code == 401


def test_refusals_before_any_job(client: OpenAI, server: ApiServer) -> None:
    with server.app.state.vlmq.db.session() as session:
        before = session.scalar(select(Job.id).order_by(Job.created_at.desc()).limit(1))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages(), stream=True)  # type: ignore[arg-type]
    assert refused.value.param == "stream" and refused.value.code == "unsupported_value"
    with pytest.raises(openai.UnprocessableEntityError) as refused_n:  # n > 1, as POST /v1/jobs answers it
        client.chat.completions.create(model=MODEL, messages=messages(), n=2)  # type: ignore[arg-type]
    assert refused_n.value.param == "n"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=messages())  # type: ignore[arg-type]
    assert unknown.value.code == "model_not_found"
    bad_image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}]}]
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=MODEL, messages=bad_image)  # type: ignore[arg-type]
    with server.client() as http:
        assert http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
                         ).status_code == 400
        assert http.post("/v1/chat/completions", data={"prompt": "hi"}).status_code == 415
    with server.app.state.vlmq.db.session() as session:
        assert session.scalar(select(Job.id).order_by(Job.created_at.desc()).limit(1)) == before


def _answered_after(server: ApiServer, end: Callable[[str], None]) -> tuple[str, httpx.Response]:
    """A chat completion sent, its job ended by `end(job_id)` while the request waits; (job id, answer)."""
    key = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool, server.client() as http:
        answer: Future[httpx.Response] = pool.submit(
            http.post, "/v1/chat/completions", json={"model": MODEL, "messages": messages(), "max_tokens": 5},
            headers={"Idempotency-Key": key})
        job_id = job_with_key(server, key)
        end(job_id)
        return job_id, answer.result(30)


def test_a_succeeded_job_answers_its_chat_completion(client: OpenAI, server: ApiServer) -> None:
    key = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.chat.completions.create, model=MODEL, messages=messages(), max_tokens=5,  # type: ignore[arg-type]
                             extra_headers={"Idempotency-Key": key})
        job_id = job_with_key(server, key)
        with server.client() as http:
            job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "queued" and job["priority"] == 9  # interactive: ahead of every other job
        end_job(server, job_id, status=JobStatus.SUCCEEDED, result_text="A red square.", finish_reason="stop",
                prompt_tokens=21, completion_tokens=4, result_key=f"results/{job_id}.json")
        completion = answer.result(30)
    assert completion.id == f"chatcmpl-{job_id}" and completion.object == "chat.completion"
    assert completion.model == MODEL and completion.choices[0].message.content == "A red square."
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].message.role == "assistant"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        21, 4, 25)
    assert completion._request_id == job_id  # x-request-id


@pytest.mark.parametrize(("status", "code", "http_status", "kind"), [
    (JobStatus.FAILED, "invalid_input", 400, "invalid_request_error"),
    (JobStatus.DEAD, "worker_error", 500, "server_error"),
])
def test_a_job_that_ends_badly_answers_an_openai_error(server: ApiServer, status: str, code: str, http_status: int,
                                                       kind: str) -> None:
    job_id, answer = _answered_after(server, lambda job_id: end_job(
        server, job_id, status=status, error_code=code, error_message="cannot identify image file"))
    assert answer.status_code == http_status, answer.text
    assert answer.json()["error"] == {"message": f"job {job_id} {status}: cannot identify image file",
                                      "type": kind, "code": code, "param": None}
    # Sent again, it would be a new job (the openai client would retry a 500 on its own).
    assert answer.headers["x-should-retry"] == "false" and answer.headers["x-request-id"] == job_id


def test_a_cancelled_job_answers_409(server: ApiServer) -> None:
    def cancel(job_id: str) -> None:
        with server.client() as http:
            assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200

    job_id, answer = _answered_after(server, cancel)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "job_cancelled", answer.text
    assert job_id in answer.json()["error"]["message"]


def test_past_the_wait_limit_a_504_names_the_job_which_carries_on(server: ApiServer) -> None:
    body = {"model": MODEL, "messages": messages("wait"), "max_tokens": 3}
    with server.client() as http:
        started = time.monotonic()
        answer = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "chat-504"})
        waited = time.monotonic() - started
        assert answer.status_code == 504, answer.text
        assert WAIT_S <= waited < WAIT_S + 5
        job_id = answer.headers["x-request-id"]
        assert answer.headers["location"] == f"/v1/jobs/{job_id}" and answer.headers["x-should-retry"] == "false"
        error = answer.json()["error"]
        assert error["code"] == "timeout" and f"GET /v1/jobs/{job_id}" in error["message"]
        assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        # The same Idempotency-Key finds the same job: once it has ended, its answer.
        end_job(server, job_id, status=JobStatus.SUCCEEDED, result_text="late", finish_reason="length",
                prompt_tokens=3, completion_tokens=3, result_key=f"results/{job_id}.json")
        again = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "chat-504"})
        assert again.status_code == 200 and again.json()["id"] == f"chatcmpl-{job_id}", again.text
        assert again.json()["choices"][0]["finish_reason"] == "length"


def test_waiting_requests_share_their_sql_queries(server: ApiServer) -> None:
    """Ten requests waiting out the limit together cost fewer lookups than one request alone makes."""
    looks: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "jobs.result_text" in statement and "jobs.status IN" in statement:
            looks.append(statement)

    engine = server.app.state.vlmq.db.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        with server.client() as http:
            alone = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages("alone")})
            assert alone.status_code == 504
            one_request = len(looks)
            looks.clear()
            with ThreadPoolExecutor(10) as pool:
                answers = list(pool.map(lambda i: http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": messages(f"together {i}")}), range(10)))
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert [a.status_code for a in answers] == [504] * 10
    # Backing off from 20 ms to 0.5 s, one request looks ~10 times in 1.5 s.
    assert 5 <= one_request <= 15, one_request
    assert len(looks) <= 2 * one_request, (len(looks), one_request)


def test_the_open_jobs_limit_applies(service_env: dict[str, str]) -> None:
    limited = settings_from_env(service_env, model=f"/models/{MODEL}", chat_wait_seconds=0.2,
                                tenant_max_open_jobs=1)
    with ApiServer(limited, tenant=f"limited-{uuid.uuid4().hex[:6]}") as api, api.client() as http:
        body = {"model": MODEL, "messages": messages("limited")}
        assert http.post("/v1/chat/completions", json=body).status_code == 504  # its job stays open
        refused = http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "30", refused.text
