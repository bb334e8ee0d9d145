"""A route's session (api/deps.SessionDep) is committed before its answer is sent: a client that acts on the
answer at once finds what it was told exists. FastAPI runs a yield dependency's exit after the response
unless its scope is "function"; POST /v1/images then answered 201 before the image's row was committed, and a
job naming the image straight after was refused ("unknown image id") now and then."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.api.test_jobs_api import png_bytes
from tests.conftest import ApiServer, settings_from_env


@pytest.fixture(scope="module")
def api(service_env: dict[str, str]) -> Iterator[httpx.Client]:
    with ApiServer(settings_from_env(service_env, model="/models/tiny-deps")) as server, server.client() as client:
        yield client


def test_an_uploaded_image_can_be_named_as_soon_as_its_id_is_answered(api: httpx.Client) -> None:
    refused = []
    for i in range(60):
        image = api.post("/v1/images", files={"file": ("a.png", png_bytes((i, 7, 9)), "image/png")})
        assert image.status_code == 201, image.text
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image.json()["id"]}}, {"type": "text", "text": "what?"}]}],
            "max_tokens": 2}
        job = api.post("/v1/jobs", json=body)
        if job.status_code != 202:
            refused.append((i, job.text))
    assert not refused, refused
