"""The API's Prometheus /metrics and the status page's data, over real HTTP against Postgres, Redis and S3.

No model worker runs here: jobs stay queued (their messages wait in Redis), and a failure is made through the
job state machine as a worker would make it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.domain import jobs
from common.infra.worker_registry import Heartbeat, WorkerRegistry
from tests.api.test_jobs_api import MODEL, chat_body
from tests.conftest import ApiServer, settings_from_env


@pytest.fixture(scope="module")
def server(service_env: dict[str, str]) -> Iterator[ApiServer]:
    settings = settings_from_env(service_env, model=f"/models/{MODEL}", admin_tenants=["ops"])
    with ApiServer(settings, tenant="acme") as api:
        yield api


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(server: ApiServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(server.url + "/metrics", timeout=30)  # open, like /healthz: no key
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def test_metrics_count_requests_jobs_and_queue_depth(server: ApiServer) -> None:
    queue = server.app.state.vlmq.settings.job_queue
    with server.client() as client:
        job_ids = [client.post("/v1/jobs", json=chat_body(text=f"hi {i}")).json()["id"] for i in range(3)]
        assert client.get(f"/v1/jobs/{job_ids[0]}").status_code == 200
        assert client.get("/v1/jobs/job_nope").status_code == 404
        assert client.get("/no/such/route").status_code == 404
    time.sleep(0.1)  # the middleware counts after the response is sent
    m = scrape(server)
    assert m[("vlmq_http_requests_total", (("method", "POST"), ("route", "/v1/jobs"), ("status", "202")))] >= 3
    # Labelled by the route's template, so job ids never become label values.
    assert m[("vlmq_http_requests_total", (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "200")))] >= 1
    assert m[("vlmq_http_requests_total", (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404")))] >= 1
    assert m[("vlmq_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404")))] >= 1
    assert m[("vlmq_http_request_duration_seconds_count", (("method", "POST"), ("route", "/v1/jobs")))] >= 3
    assert m[("vlmq_jobs", (("status", "queued"),))] >= 3
    assert m[("vlmq_queue_depth", (("queue", queue),))] >= 3  # no worker: the messages wait in Redis
    assert ("vlmq_queue_depth", (("queue", "ingest"),)) in m
    assert m[("vlmq_processes", (("role", "worker"),))] >= 0


def test_metrics_list_live_processes_and_their_throughput(server: ApiServer) -> None:
    settings = server.app.state.vlmq.settings
    beat = Heartbeat(WorkerRegistry(settings.broker_url), "worker", 1.0,
                     lambda: {"model": "m", "tokens_per_s": 12.5}, process="host:1:test").start()
    try:
        m = scrape(server)
        assert m[("vlmq_processes", (("role", "worker"),))] >= 1
        assert m[("vlmq_worker_tokens_per_second", (("model", "m"), ("worker_id", "host:1:test")))] == 12.5
    finally:
        beat.close()
    assert not [r for r in WorkerRegistry(settings.broker_url).list() if r["id"] == "host:1:test"]


def _fail_a_job(server: ApiServer, client: httpx.Client, text: str) -> str:
    job_id = client.post("/v1/jobs", json=chat_body(text=text)).json()["id"]
    with server.app.state.vlmq.db.session() as session:
        assert jobs.claim(session, job_id, "test-worker", 60) is not None
        assert jobs.fail(session, job_id, "test-worker", "invalid_input", f"prompt too long <b>{text}</b>")
    return job_id


def test_status_data_needs_a_key_and_shows_only_the_keys_tenant(server: ApiServer) -> None:
    assert httpx.get(server.url + "/status/data", timeout=30).status_code == 401
    page = httpx.get(server.url + "/status", timeout=30)  # the shell holds no data
    assert page.status_code == 200 and "vlmq status" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    other, ops = server.make_key("globex"), server.make_key("ops")
    settings = server.app.state.vlmq.settings
    engine = {"model": "m", "tokens_per_s": 3.0, "prefix_cache_hit_rate": 0.25, "encoder_cache_hit_rate": 0.5}
    beat = Heartbeat(WorkerRegistry(settings.broker_url), "worker", 1.0, lambda: engine,
                     process="host:2:test").start()
    try:
        with server.client() as acme, server.client(api_key=other) as globex, server.client(api_key=ops) as admin:
            mine = _fail_a_job(server, acme, "acme")
            theirs = _fail_a_job(server, globex, "globex")
            a, g, o = (c.get("/status/data").json() for c in (acme, globex, admin))
    finally:
        beat.close()
    # The workers' figures and the queue depths are every tenant's load: only admins see them.
    worker = next(p for p in o["processes"] if p["id"] == "host:2:test")
    assert worker["prefix_cache_hit_rate"] == 0.25 and worker["encoder_cache_hit_rate"] == 0.5
    assert worker["tokens_per_s"] == 3.0 and server.app.state.vlmq.settings.job_queue in o["queues"]
    for tenant_view in (a, g):
        assert set(tenant_view) == {"tenant", "generated_at", "jobs", "batches", "failures", "errors", "scope"}
        assert "host:2:test" not in str(tenant_view) and "tokens_per_s" not in str(tenant_view)
        assert all("worker" not in f for f in tenant_view["failures"])
    assert any(f.get("worker") == "test-worker" for f in o["failures"])
    assert a["scope"] == "tenant acme" and o["scope"] == "all tenants"
    assert mine in {f["id"] for f in a["failures"]} and theirs not in {f["id"] for f in a["failures"]}
    assert theirs in {f["id"] for f in g["failures"]} and mine not in {f["id"] for f in g["failures"]}
    assert {mine, theirs} <= {f["id"] for f in o["failures"]}
    failure = next(f for f in a["failures"] if f["id"] == mine)
    assert failure["error_code"] == "invalid_input" and failure["error_message"] == "prompt too long <b>acme</b>"
    assert a["jobs"]["failed"] >= 1 and g["jobs"]["failed"] == 1 and o["jobs"]["failed"] >= 2
