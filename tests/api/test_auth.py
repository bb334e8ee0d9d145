"""Access over real HTTP: bearer keys on every /v1 route, and tenants that cannot see each other's things.

Another tenant's job, file or batch answers 404 exactly like one that does not exist, so ids leak nothing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import openai
import pytest
from openai import OpenAI
from pydantic import ValidationError

from common.infra.settings import Settings
from tests.api.test_jobs_api import MODEL, chat_body, png_bytes
from tests.conftest import ApiServer, settings_from_env


@pytest.fixture(scope="module")
def server(service_env: dict[str, str]) -> Iterator[ApiServer]:
    # A cache of 0 s: a revoked key stops working at once (the default trusts a checked key for 10 s).
    settings = settings_from_env(service_env, model=f"/models/{MODEL}", auth_cache_seconds=0)
    with ApiServer(settings, tenant="acme") as api:
        yield api


def test_every_v1_route_needs_a_key(server: ApiServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert anonymous.get("/healthz").status_code == 200  # probes stay open
        for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/job_x"),
                             ("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                             ("POST", "/v1/batches"), ("POST", "/v1/datasets"), ("POST", "/v1/images"),
                             ("GET", "/v1/images/img_x")):
            response = anonymous.request(method, path)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        for header in ("Bearer vlmq-key_00.nope", "Basic dXNlcjpwYXNz", "Bearer", "bearer  x",
                       "Bearer " + server.api_key + "x"):
            response = anonymous.get("/v1/jobs", headers={"Authorization": header})
            assert response.status_code == 401, header


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(server: ApiServer) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="sk-not-ours", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.batches.list()
    ours = OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
    assert ours.files.create(file=("x.jsonl", b"{}\n"), purpose="batch").id in {f.id for f in ours.files.list()}


def test_tenants_see_only_their_own(server: ApiServer) -> None:
    other_key = server.make_key("globex")
    with server.client() as acme, server.client(api_key=other_key) as globex:
        job = acme.post("/v1/jobs", json=chat_body(text="acme's secret"))
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]
        file_id = acme.post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"}).json()["id"]
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/result", f"/v1/files/{file_id}",
                     f"/v1/files/{file_id}/content"):
            assert globex.get(path).status_code == 404, path
            assert acme.get(path).status_code in (200, 409), path  # 409: a result before the job ran
        assert globex.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert globex.delete(f"/v1/files/{file_id}").status_code == 404
        assert job_id not in {j["id"] for j in globex.get("/v1/jobs").json()["data"]}
        assert file_id not in {f["id"] for f in globex.get("/v1/files").json()["data"]}
        # A batch can only be made of the tenant's own files.
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        refused = globex.post("/v1/batches", json=body)
        assert refused.status_code == 404 and "no such file" in refused.json()["error"]["message"]
        batch = acme.post("/v1/batches", json=body)
        assert batch.status_code == 200, batch.text
        batch_id = batch.json()["id"]
        assert globex.get(f"/v1/batches/{batch_id}").status_code == 404
        assert globex.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
        assert batch_id not in {b["id"] for b in globex.get("/v1/batches").json()["data"]}
        assert acme.get(f"/v1/batches/{batch_id}").json()["id"] == batch_id
        # The job is still acme's to cancel.
        assert acme.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"


def test_a_tenant_sees_and_names_only_images_it_stored(server: ApiServer) -> None:
    """Images are stored once for everyone, but another tenant's image is not found, by lookup or in a job,
    exactly like one never uploaded: holding an image's bytes does not tell whether someone else sent it."""
    secret = png_bytes((201, 13, 77), (7, 9))
    never = png_bytes((1, 2, 3), (7, 9))
    with server.client() as acme, server.client(api_key=server.make_key("initech")) as initech:
        uploaded = acme.post("/v1/images", files={"file": ("s.png", secret, "image/png")})
        assert uploaded.status_code == 201, uploaded.text
        image_id = uploaded.json()["id"]
        never_id = f"img_{hashlib.sha256(never).hexdigest()}"
        assert acme.get(f"/v1/images/{image_id}").status_code == 200
        for probe in (image_id, never_id):
            looked_up = initech.get(f"/v1/images/{probe}")
            assert looked_up.status_code == 404
            assert looked_up.json()["error"]["message"] == f"image {probe!r} not found"
            named = initech.post("/v1/jobs", json=chat_body(probe))
            assert named.status_code == 400 and named.json()["error"]["code"] == "unknown_image", named.text
        # acme's job naming it by id is accepted (and, once known to the API, by its id alone).
        for _ in range(2):
            assert acme.post("/v1/jobs", json=chat_body(image_id)).status_code == 202
        # Sending the bytes themselves makes them initech's own too; acme keeps its.
        again = initech.post("/v1/images", files={"file": ("mine.png", secret, "image/png")})
        assert again.status_code == 201 and again.json()["id"] == image_id
        # Its own time of upload: acme's would say that someone sent these bytes before.
        uploaded_at = [datetime.fromisoformat(r.json()["created_at"]) for r in (uploaded, again)]
        assert uploaded_at[1] > uploaded_at[0]
        assert initech.get(f"/v1/images/{image_id}").json() == again.json()
        assert initech.post("/v1/jobs", json=chat_body(image_id)).status_code == 202
        assert acme.get(f"/v1/images/{image_id}").json() == uploaded.json()
        # A job's multipart image is the job's tenant's too.
        form = initech.post("/v1/jobs", data={"prompt": "what?"}, files={"image": ("n.png", never, "image/png")})
        assert form.status_code == 202, form.text
        assert initech.get(f"/v1/images/{never_id}").status_code == 200
        assert acme.get(f"/v1/images/{never_id}").status_code == 404


def test_idempotency_keys_belong_to_their_tenant(server: ApiServer) -> None:
    other_key = server.make_key("initech")
    with server.client() as acme, server.client(api_key=other_key) as initech:
        headers = {"Idempotency-Key": "order-42"}
        first = acme.post("/v1/jobs", json=chat_body(), headers=headers)
        again = acme.post("/v1/jobs", json=chat_body(), headers=headers)
        theirs = initech.post("/v1/jobs", json=chat_body(), headers=headers)
    assert (first.status_code, again.status_code, theirs.status_code) == (202, 200, 202)
    assert first.json()["id"] == again.json()["id"] != theirs.json()["id"]


def test_a_revoked_key_stops_working(server: ApiServer) -> None:
    from common.domain.apikeys import revoke_key

    key = server.make_key("acme")
    with server.client(api_key=key) as client:
        assert client.get("/v1/jobs").status_code == 200
        with server.app.state.vlmq.db.session() as session:
            assert revoke_key(session, key.split(".")[0].removeprefix("vlmq-"))
        assert client.get("/v1/jobs").status_code == 401


def test_auth_may_be_off_only_in_embedded_mode(service_env: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="only in embedded mode"):
        settings_from_env(service_env, auth="off")
    assert not Settings(broker_url="memory://").auth_required
    assert Settings(broker_url="memory://", auth="on").auth_required
    assert settings_from_env(service_env).auth_required


def test_tenant_limits_answer_429_with_retry_after(service_env: dict[str, str]) -> None:
    settings = settings_from_env(service_env, model=f"/models/{MODEL}", tenant_requests_per_second=5,
                                 tenant_max_open_jobs=3)
    with ApiServer(settings, tenant="limited") as api, api.client() as client, \
            api.client(api_key=api.make_key("neighbour")) as neighbour:
        time.sleep(1.0 - time.time() % 1.0)  # start at the beginning of a one-second window
        codes = [client.get("/v1/jobs").status_code for _ in range(4)]
        codes += [client.get("/status/data").status_code for _ in range(4)]  # its queries count too
        assert codes[:5] == [200] * 5 and set(codes[5:]) == {429}
        refused = client.get("/v1/jobs")
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert neighbour.get("/v1/jobs").status_code == 200  # another tenant has its own count
        time.sleep(1.0)
        submitted = [client.post("/v1/jobs", json=chat_body()).status_code for _ in range(4)]
        assert submitted == [202, 202, 202, 429]  # three jobs open: the limit
        time.sleep(1.0)
        over = client.post("/v1/jobs", json=chat_body())
        assert over.status_code == 429 and "jobs queued or running" in over.json()["error"]["message"]
        assert neighbour.post("/v1/jobs", json=chat_body()).status_code == 202


def test_each_tenants_objects_lie_under_its_own_prefix(server: ApiServer, service_env: dict[str, str]) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=service_env["VLMQ_S3_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = service_env["VLMQ_S3_BUCKET"]
    other_key = server.make_key("initech")
    for tenant, key in (("acme", server.api_key), ("initech", other_key)):
        with server.client(api_key=key) as client:
            file_id = client.post("/v1/files", data={"purpose": "batch"},
                                  files={"file": ("in.jsonl", b"{}\n", "application/jsonl")}).json()["id"]
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"tenants/{tenant}/files/")
        assert f"tenants/{tenant}/files/{file_id}" in {o["Key"] for o in listed.get("Contents", [])}


def test_a_burst_cannot_overshoot_the_open_jobs_limit(service_env: dict[str, str]) -> None:
    """Twenty submissions at once, none counted yet in SQL: exactly the limit's worth pass in one process."""
    settings = settings_from_env(service_env, model=f"/models/{MODEL}", tenant_max_open_jobs=3)
    with ApiServer(settings, tenant="burst") as api, api.client() as client, ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(lambda _: client.post("/v1/jobs", json=chat_body()).status_code, range(20)))
        assert sorted(codes) == [202] * 3 + [429] * 17
        listed = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
        assert len(listed) == 3
