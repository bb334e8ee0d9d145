"""The app's OpenAPI schema against the app itself (schemathesis), over real HTTP with Postgres, Redis and S3.

Every documented operation gets generated requests, valid and invalid; whatever comes back must not be a 5xx and
must be what the schema says: a declared status code, the declared content type, a body of the declared shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from tests.api.test_jobs_api import png_bytes
from tests.conftest import ApiServer, settings_from_env

MODEL = "tiny-vlm"

# The checks this suite is about: no server errors, and responses as documented.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]


@pytest.fixture(scope="module")
def server(service_env: dict[str, str]) -> Iterator[ApiServer]:
    # A served model, so that valid job submissions get past the model check and are written and dispatched;
    # no worker runs them, so a chat completion answers 504 once its short wait is over.
    with ApiServer(settings_from_env(service_env, model=f"/models/{MODEL}", chat_wait_seconds=0.2)) as api:
        yield api


def _app_schema() -> dict:
    """The app's OpenAPI document, read from an app built offline (routes do not depend on where data lives).

    Loaded at import because schemathesis makes one test per operation at collection time;
    test_served_schema_is_the_one_tested checks that the running server serves this very document."""
    import tempfile

    from api.main import create_app
    from common.infra.settings import Settings

    with tempfile.TemporaryDirectory() as folder:
        app = create_app(Settings(data_dir=Path(folder), database_url=f"sqlite:///{folder}/schema.db", model=MODEL))
        document = app.openapi()
        app.state.vlmq.db.dispose()
    return document


APP_SCHEMA = _app_schema()
schema = schemathesis.openapi.from_dict(APP_SCHEMA)


def test_served_schema_is_the_one_tested(server: ApiServer) -> None:
    with server.client() as client:
        assert client.get("/openapi.json").json() == APP_SCHEMA


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_matches_its_openapi_schema(case: schemathesis.Case, server: ApiServer) -> None:
    if (case.method, case.path) == ("POST", "/v1/chat/completions"):
        # No worker runs jobs here: a valid chat completion waits out its limit and answers 504 (documented),
        # the one server error allowed.
        response = case.call_and_validate(base_url=server.url, headers=server.headers,
                                          checks=[c for c in CHECKS if c is not checks.not_a_server_error],
                                          excluded_checks=[checks.not_a_server_error])
        assert response.status_code < 500 or response.status_code == 504, response.text
        return
    case.call_and_validate(base_url=server.url, headers=server.headers, checks=CHECKS)


def _conforms(response: httpx.Response) -> httpx.Response:
    """`response` has a status code its operation documents, and the documented content type and body."""
    request = response.request
    path = request.url.path
    template = next(t for t in APP_SCHEMA["paths"]
                    if re.fullmatch(re.sub(r"\{[^/]+\}", "[^/]+", t), path) and request.method.lower() in
                    APP_SCHEMA["paths"][t])
    documented = APP_SCHEMA["paths"][template][request.method.lower()]["responses"]
    assert str(response.status_code) in documented, (request.method, path, response.status_code, response.text)
    request.read()  # schemathesis reads the request back; a multipart one was streamed
    schema[template][request.method].validate_response(response)
    return response


def test_real_resources_match_the_schema(server: ApiServer) -> None:
    """Generated ids never name a real job, file or batch: walk the 2xx and 409 answers on real ones."""
    manifest = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}) + "\n"
    with server.client() as client, httpx.Client(base_url=server.url) as anonymous:
        _conforms(anonymous.get("/v1/jobs"))  # 401
        image = _conforms(client.post("/v1/images", files={"file": ("a.png", png_bytes(), "image/png")})).json()
        _conforms(client.get(f"/v1/images/{image['id']}"))
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image["id"]}},
                                                          {"type": "text", "text": "what is it?"}]}],
                "max_tokens": 4, "metadata": {"k": "v"}}
        job = _conforms(client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "schema-1"})).json()
        again = _conforms(client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "schema-1"}))
        assert again.status_code == 200, again.text
        _conforms(client.post("/v1/jobs", data={"prompt": "and this?", "max_tokens": "4"},
                              files={"image": ("b.png", png_bytes((0, 0, 255)), "image/png")}))
        _conforms(client.get(f"/v1/jobs/{job['id']}"))
        _conforms(client.get("/v1/jobs", params={"status": "queued", "limit": 1}))
        assert _conforms(client.get(f"/v1/jobs/{job['id']}/result")).status_code == 409
        _conforms(client.post(f"/v1/jobs/{job['id']}/cancel"))
        _conforms(client.post(f"/v1/jobs/{job['id']}/cancel"))  # already cancelled: the same answer
        _conforms(client.get("/v1/models"))
        _conforms(client.get(f"/v1/models/{MODEL}"))
        assert _conforms(client.get("/v1/models/other")).status_code == 404
        chat = {k: v for k, v in body.items() if k != "metadata"}  # OpenAI's body, as a batch line holds it
        assert _conforms(client.post("/v1/chat/completions", json=chat)).status_code == 504
        assert _conforms(client.post("/v1/chat/completions", json={**chat, "stream": True})).status_code == 400

        file = _conforms(client.post("/v1/files", data={"purpose": "batch"},
                                     files={"file": ("in.jsonl", manifest.encode(), "application/jsonl")})).json()
        _conforms(client.get(f"/v1/files/{file['id']}"))
        _conforms(client.get("/v1/files", params={"limit": 2}))
        assert _conforms(client.get(f"/v1/files/{file['id']}/content")).content == manifest.encode()
        _conforms(client.get(f"/v1/files/{file['id']}/url"))
        batch = _conforms(client.post("/v1/batches", json={
            "input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})).json()
        # No ingest worker runs here: the batch stays `validating`, so its input file cannot be deleted yet.
        assert _conforms(client.delete(f"/v1/files/{file['id']}")).status_code == 409
        _conforms(client.get(f"/v1/batches/{batch['id']}"))
        _conforms(client.get("/v1/batches", params={"limit": 1}))
        _conforms(client.post(f"/v1/batches/{batch['id']}/cancel"))
        _conforms(client.post("/v1/datasets", files={"manifest": ("m.jsonl", manifest.encode(), "application/jsonl")}))
