"""The jobs and images API over real HTTP, on Postgres, Redis and the S3 server (no worker needed here)."""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from PIL import Image

from common.images.pack import ImagePack
from common.images.stored import store_image
from common.infra.db import get_database
from common.infra.settings import Settings
from common.infra.storage import make_store
from tests.conftest import ApiServer, settings_from_env
from tests.redis_text import text

MODEL = "tiny-test-model"


def png_bytes(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_body(image_url: str | None = None, text: str = "What is this?", **extra: object) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if image_url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env, model=f"/models/{MODEL}", max_body_bytes=256 * 1024,
                             max_image_pixels=1_000_000)


@pytest.fixture(scope="module")
def api(settings: Settings) -> Iterator[httpx.Client]:
    with ApiServer(settings) as server, server.client(timeout=30) as client:
        yield client


def test_health_and_ready(api: httpx.Client) -> None:
    assert api.get("/healthz").json() == {"status": "ok"}
    ready = api.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"sql": "ok", "broker": "ok", "storage": "ok"}


def test_submit_json_job_is_queued_and_dispatched(api: httpx.Client, settings: Settings) -> None:
    response = api.post("/v1/jobs", json=chat_body(data_url(png_bytes()), priority=7, metadata={"k": "v"}))
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["model"] == MODEL and job["priority"] == 7
    assert job["metadata"] == {"k": "v"} and job["attempts"] == 0 and job["result"] is None
    assert api.get(f"/v1/jobs/{job['id']}").json()["id"] == job["id"]
    # The Celery message sits in the model's Redis queue, addressed to the task by name.
    # Celery keeps one Redis list per priority step: "<queue>" and "<queue>\x06\x16<step>".
    client = redis.Redis.from_url(settings.broker_url)
    keys = [k for k in client.keys(settings.job_queue + "*") if text(k).startswith(settings.job_queue)]
    bodies = [json.loads(m) for key in keys for m in client.lrange(key, 0, -1)]
    mine = [b for b in bodies if b["headers"]["argsrepr"] == repr([job["id"]])]
    assert len(mine) == 1 and mine[0]["headers"]["task"] == "vlmq.run_job"
    assert mine[0]["properties"]["priority"] == 2  # our 7 is Celery's 2 (0 is highest on Redis)


def test_upload_image_once_and_reference_it(api: httpx.Client) -> None:
    data = png_bytes((1, 2, 3))
    first = api.post("/v1/images", files={"file": ("a.png", data, "image/png")})
    second = api.post("/v1/images", files={"file": ("b.png", data, "image/png")})
    assert first.status_code == 201 and second.status_code == 201
    image = first.json()
    assert image["id"] == second.json()["id"] and image["id"].startswith("img_")
    assert (image["width"], image["height"], image["format"]) == (24, 16, "PNG")
    assert api.get(f"/v1/images/{image['id']}").json()["sha256"] == image["sha256"]
    job = api.post("/v1/jobs", json=chat_body(image["id"]))
    assert job.status_code == 202, job.text


def test_multipart_job(api: httpx.Client) -> None:
    response = api.post(
        "/v1/jobs",
        data={"prompt": "Describe.", "max_tokens": "5", "priority": "9", "stop": ["\n"]},
        files=[("image", ("x.png", png_bytes((9, 9, 9)), "image/png")),
               ("image", ("y.png", png_bytes((8, 8, 8)), "image/png"))],
    )
    assert response.status_code == 202, response.text
    assert response.json()["priority"] == 9


def test_idempotency_key_returns_same_job(api: httpx.Client) -> None:
    key = f"key-{uuid.uuid4()}"
    first = api.post("/v1/jobs", json=chat_body(text="one"), headers={"Idempotency-Key": key})
    again = api.post("/v1/jobs", json=chat_body(text="one"), headers={"Idempotency-Key": key})
    assert first.status_code == 202 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    # With an image, metadata and priority, the same body is still the same request.
    body = {**chat_body(data_url(png_bytes()), text="two"), "metadata": {"a": [1, 2.5]}, "priority": 7}
    key = f"key-{uuid.uuid4()}"
    assert api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}).status_code == 202
    assert api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key}).status_code == 200
    # The key reused for another request is the client's mistake, not a silent replay of the first job.
    for changed in ({**body, "priority": 6}, {**body, "metadata": {"a": [1]}}, {**body, "max_tokens": 3},
                    chat_body(data_url(png_bytes((1, 2, 3))), text="two")):
        reused = api.post("/v1/jobs", json=changed, headers={"Idempotency-Key": key})
        assert reused.status_code == 422, reused.text
        assert reused.json()["error"]["code"] == "idempotency_key_reused"


def test_a_retry_is_the_same_request_wherever_its_image_lies(api: httpx.Client, settings: Settings) -> None:
    """Bytes another tenant's ingestion packed first: this tenant's first request stores them anew, its retry
    finds them owned, with the shared row's pack as their place. Still the same request: a 422 here would also
    tell the tenant that someone else had sent those bytes."""
    picture = png_bytes((uuid.uuid4().bytes[0], 77, 99))
    store = make_store(settings)
    pack = ImagePack(store, settings.image_pack_bytes)
    with get_database(settings.database_url).session() as session:
        assert store_image(session, store, picture, settings, "another-tenant", pack).pack is not None
        pack.flush()
    body, key = chat_body(data_url(picture), text="same"), f"key-{uuid.uuid4()}"
    first = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
    again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 202 and again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]


def test_list_with_status_filter_and_cursor(api: httpx.Client) -> None:
    ids = [api.post("/v1/jobs", json=chat_body(text=f"list {i}")).json()["id"] for i in range(5)]
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"status": "queued", "limit": 2, **({"after": cursor} if cursor else {})}
        page = api.get("/v1/jobs", params=params).json()
        assert all(j["status"] == "queued" for j in page["data"])
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    assert seen == sorted(seen, reverse=True)  # newest first, no repeats
    assert len(seen) == len(set(seen)) and set(ids) <= set(seen)
    bad = api.get("/v1/jobs", params={"status": "nonsense"})
    assert bad.status_code == 422 and "status" in bad.json()["error"]["message"]


def test_cancel(api: httpx.Client) -> None:
    job_id = api.post("/v1/jobs", json=chat_body(text="cancel me")).json()["id"]
    cancelled = api.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    result = api.get(f"/v1/jobs/{job_id}/result")
    assert result.status_code == 409 and "cancelled" in result.json()["error"]["message"]


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": MODEL}, "messages: Field required"),
        ({"model": MODEL, "messages": []}, "messages: List should have at least 1 item"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (chat_body(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (chat_body(temperature=5), "temperature"),
        (chat_body(priority=12), "priority"),
        (chat_body(n=3), "n: Input should be 1"),
        (chat_body(stop=["a", "b", "c", "d", "e"]), "at most 4 stop sequences"),
        (chat_body(max_tokens=10**9), "exceeds this server's limit"),
        (chat_body(bogus=1), "bogus: Extra inputs are not permitted"),
    ],
)
def test_invalid_bodies_are_4xx_with_a_message(api: httpx.Client, body: dict, fragment: str) -> None:
    response = api.post("/v1/jobs", json=body)
    assert response.status_code in (400, 422), response.text
    assert fragment in response.json()["error"]["message"]


def test_unknown_model_is_404(api: httpx.Client) -> None:
    body = {**chat_body(), "model": "gpt-7"}
    assert "not served here" in _error(api.post("/v1/jobs", json=body), 404)


def test_unknown_image_id(api: httpx.Client) -> None:
    message = _error(api.post("/v1/jobs", json=chat_body("img_" + "0" * 64)), 400)
    assert "unknown image id" in message


def test_undecodable_images(api: httpx.Client) -> None:
    assert "not a recognized image" in _error(api.post("/v1/jobs", json=chat_body(data_url(b"not an image"))), 400)
    truncated = png_bytes()[:-30]
    assert "truncated or corrupt" in _error(api.post("/v1/jobs", json=chat_body(data_url(truncated))), 400)
    assert "base64" in _error(api.post("/v1/jobs", json=chat_body("data:image/png;base64,@@@")), 400)
    big = png_bytes(size=(2000, 1000))  # 2 MP > this server's 1 MP limit
    assert "too large" in _error(api.post("/v1/jobs", json=chat_body(data_url(big))), 400)
    upload = api.post("/v1/images", files={"file": ("t.png", b"GIF89a-garbage", "image/png")})
    assert "corrupt" in _error(upload, 400) or "not a recognized" in upload.json()["error"]["message"]
    remote = api.post("/v1/jobs", json=chat_body("https://example.com/cat.png"))
    assert "remote image URLs are not enabled" in _error(remote, 400)


def test_wrong_content_type_and_bad_json(api: httpx.Client) -> None:
    message = _error(api.post("/v1/jobs", content=b"prompt=hi", headers={"content-type": "text/plain"}), 415)
    assert "unsupported content type" in message
    assert "not valid JSON" in _error(
        api.post("/v1/jobs", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    assert "JSON object" in _error(api.post("/v1/jobs", json=[1, 2]), 400)
    assert "prompt" in _error(api.post("/v1/jobs", data={"x": "y"}, files={"image": ("a.png", b"z")}), 400)


def test_oversize_body_is_413(api: httpx.Client) -> None:
    huge = chat_body(text="x" * (300 * 1024))
    assert "exceeds the limit" in _error(api.post("/v1/jobs", json=huge), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while streaming
        yield b'{"model": "tiny-test-model", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 8192
        yield b'"}]}'

    streamed = api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413, streamed.text


def test_missing_job_is_404(api: httpx.Client) -> None:
    assert "not found" in _error(api.get("/v1/jobs/job_nope"), 404)
    assert "not found" in _error(api.post("/v1/jobs/job_nope/cancel"), 404)
    assert "not found" in _error(api.get("/v1/images/img_nope"), 404)


@pytest.mark.parametrize(
    "body",
    [
        chat_body("data:"),
        chat_body("data:image/png;base64,"),
        chat_body("data:image/png,notbase64"),
        chat_body("img_" + "z" * 64),
        chat_body("ftp://host/x.png"),
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"model": MODEL, "messages": "hello"},
        {"model": MODEL, "messages": [None]},
        {**chat_body(), "priority": "high"},
        {**chat_body(), "metadata": [1, 2]},
        {**chat_body(), "max_tokens": "many"},
        {**chat_body(), "stream": True},
        {**chat_body(), "seed": 1.5},
        {**chat_body(), "model": 7},
    ],
)
def test_hostile_bodies_never_500(api: httpx.Client, body: dict) -> None:
    response = api.post("/v1/jobs", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["message"]


def test_hostile_headers_and_forms_never_500(api: httpx.Client) -> None:
    long_key = api.post("/v1/jobs", json=chat_body(), headers={"Idempotency-Key": "k" * 300})
    assert long_key.status_code == 400 and "Idempotency-Key" in long_key.json()["error"]["message"]
    too_many = api.post("/v1/jobs", data={"prompt": "x"},
                        files=[("image", (f"{i}.png", png_bytes((i, i, i)), "image/png")) for i in range(20)])
    assert 400 <= too_many.status_code < 500, too_many.text
    bad_meta = api.post("/v1/jobs", data={"prompt": "x", "metadata": "{not json"})
    assert bad_meta.status_code == 400 and "metadata" in bad_meta.json()["error"]["message"]
    no_type = api.post("/v1/jobs", content=b"{}")
    assert no_type.status_code == 415
    empty_upload = api.post("/v1/images", files={"file": ("e.png", b"", "image/png")})
    assert empty_upload.status_code == 400 and "empty" in empty_upload.json()["error"]["message"]
    no_file = api.post("/v1/images", data={"x": "y"})
    assert no_file.status_code == 422


def _messages(settings: Settings, queue: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(settings.broker_url)
    keys = [k for k in client.keys(queue + "*") if text(k).startswith(queue)]
    return [json.loads(m) for key in keys for m in client.lrange(key, 0, -1)]


def test_cancelling_a_batchs_last_open_job_finalizes_the_batch(api: httpx.Client, settings: Settings) -> None:
    from common.domain import batches, jobs
    from common.infra.db import get_database

    db = get_database(settings.database_url)
    with db.session() as session:
        batch = batches.create_batch(session, input_file_id="file-x", endpoint="/v1/chat/completions",
                                     completion_window="24h", model=MODEL, metadata=None)
        batch_id = batch.id
        done, last = (jobs.create_job(session, model=MODEL, request={}, batch_id=batch_id, custom_id=c).id
                      for c in ("a", "b"))
        batches.advance_ingestion(session, batch_id, from_line=0, last_line=2, requests=2, refused=0)
        batches.start(session, batch_id)
    with db.session() as session:
        assert jobs.claim(session, done, "w", 60) is not None
    with db.session() as session:
        assert jobs.finish(session, done, "w", jobs.JobResult("results/x", "ok", "stop", 1, 1))
    assert not [m for m in _messages(settings, "ingest") if m["headers"]["argsrepr"] == repr([batch_id])]
    cancelled = api.post(f"/v1/jobs/{last}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    sent = [m for m in _messages(settings, "ingest") if m["headers"]["argsrepr"] == repr([batch_id])]
    assert [m["headers"]["task"] for m in sent] == ["vlmq.finalize_batch"]


def test_cancelling_running_work_tells_the_workers_at_once(api: httpx.Client, settings: Settings,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A running job's cancel, and a batch's, stop what workers run: the batch's running rows are cancelled in the
    request itself, and the workers told (a broadcast) to look at their leases; a queued job's cancel tells none."""
    from common.domain import batches, jobs
    from common.domain.models import Job

    told: list[str] = []
    monkeypatch.setattr("api.routes.jobs.tell_workers_to_check_leases", lambda app, what: told.append("job"))
    monkeypatch.setattr("api.routes.batches.tell_workers_to_check_leases", lambda app, what: told.append("batch"))
    db = get_database(settings.database_url)
    queued, running = (api.post("/v1/jobs", json=chat_body(text=t)).json()["id"] for t in ("queued", "running"))
    with db.session() as session:
        assert jobs.claim(session, running, "w", 60) is not None
    assert api.post(f"/v1/jobs/{queued}/cancel").json()["status"] == "cancelled" and told == []
    assert api.post(f"/v1/jobs/{running}/cancel").json()["status"] == "cancelled" and told == ["job"]
    with db.session() as session:
        batch_id = batches.create_batch(session, input_file_id="file-x", endpoint="/v1/chat/completions",
                                        completion_window="24h", model=MODEL, metadata=None).id
        rows = [jobs.create_job(session, model=MODEL, request={}, batch_id=batch_id, custom_id=c).id for c in "ab"]
        batches.advance_ingestion(session, batch_id, from_line=0, last_line=2, requests=2, refused=0)
        batches.start(session, batch_id)
    with db.session() as session:
        assert jobs.claim(session, rows[0], "w", 60) is not None
    assert api.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"
    assert told == ["job", "batch"]
    with db.session() as session:  # the running row at once; the queued one is the cancel task's
        assert [session.get(Job, row).status for row in rows] == ["cancelled", "queued"]  # type: ignore[union-attr]
        assert not jobs.finish(session, rows[0], "w", jobs.JobResult(None, "late", "stop", 1, 1))


def test_nul_characters_are_kept_not_a_500(api: httpx.Client) -> None:
    """Postgres text refuses NUL; JSON allows it in any string, so a job carries it through."""
    body = {**chat_body(), "metadata": {"k\u0000": "v\u0000"}}
    body["messages"][0]["content"].append({"type": "text", "text": "a\u0000b"})
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = api.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["metadata"] == {"k\u0000": "v\u0000"}
    form = api.post("/v1/jobs", data={"prompt": "x\u0000y", "metadata": '{"a": "\\u0000"}'})
    assert form.status_code == 202, form.text
    assert api.get(f"/v1/jobs/{form.json()['id']}").json()["metadata"] == {"a": "\u0000"}


def test_concurrent_submissions_are_committed_together_and_each_answered(api: httpx.Client) -> None:
    """POST /v1/jobs writes jobs that arrive together in one transaction (api/job_writer.py): every request
    gets its own job, and a bad one among them is refused alone."""
    from concurrent.futures import ThreadPoolExecutor

    image = api.post("/v1/images", files={"file": ("c.png", png_bytes((9, 90, 200)), "image/png")}).json()["id"]
    bodies = [chat_body(image if i % 3 else None, text=f"job {i}", metadata={"i": str(i)}) for i in range(40)]
    bodies[17] = {**chat_body(), "max_tokens": 10**9}
    bodies[23] = chat_body("img_" + "0" * 64)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda b: api.post("/v1/jobs", json=b), bodies))
    assert [a.status_code for a in answers] == [400 if i in (17, 23) else 202 for i in range(40)]
    ids = [a.json()["id"] for a in answers if a.status_code == 202]
    assert len(set(ids)) == 38
    for i, job_id in zip([i for i in range(40) if i not in (17, 23)], ids, strict=True):
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "queued" and job["metadata"] == {"i": str(i)}, (i, job)  # its own answer
