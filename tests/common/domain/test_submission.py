"""common/domain/submission.py: a request checked and normalised into a job's stored request (SQLite, a local
folder)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from common.domain.schemas import ChatCompletionRequest, JobCreate
from common.domain.submission import SubmissionError, needs_session, normalize_request
from common.images.stored import owned_image, store_image
from common.infra.db import get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import make_store
from tests.api.test_jobs_api import chat_body, data_url, png_bytes


def _request(*urls: str) -> ChatCompletionRequest:
    body = chat_body()
    body["messages"][0]["content"][:0] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatCompletionRequest.model_validate(body)


def test_a_jobs_images_may_hold_at_most_max_job_pixels_however_they_are_named(tmp_path: Path) -> None:
    """Sent as bytes, or named by id (looked up, or already known to this process), the images' pixels add
    up against the limit, and a job over it is refused before it is written."""
    settings = Settings(data_dir=tmp_path, max_job_pixels=5_000)
    upgrade(settings.database_url)
    db, store = get_database(settings.database_url), make_store(settings)
    wide, small = png_bytes(size=(60, 50)), png_bytes((1, 2, 3), size=(20, 20))  # 3,000 and 400 pixels
    with db.session() as session:
        wide_id = "img_" + store_image(session, store, wide, settings, "acme").id
        for urls in ([data_url(wide), data_url(small)], [wide_id, data_url(small)]):
            normalize_request(_request(*urls), session, store, settings, tenant="acme")
        for urls in ([data_url(wide), data_url(wide)], [wide_id, data_url(wide)], [wide_id, wide_id]):
            with pytest.raises(SubmissionError) as refused:
                normalize_request(_request(*urls), session, store, settings, tenant="acme")
            assert (refused.value.status_code, refused.value.code) == (400, "too_many_pixels")
            assert "5,000 pixels" in str(refused.value)
    # The id is known to this process now: no session needed, and its pixels still count.
    normalize_request(_request(wide_id), None, store, settings, tenant="acme")
    with pytest.raises(SubmissionError, match="pixels"):
        normalize_request(_request(wide_id, wide_id), None, store, settings, tenant="acme")


def test_openai_nulls_mean_the_defaults_and_a_developer_message_is_a_system_message(tmp_path: Path) -> None:
    """The openai client sends null for an argument given as None; newer OpenAI models take instructions as
    a `developer` message, which chat templates know as `system`."""
    settings = Settings(data_dir=tmp_path)
    body = {"messages": [{"role": "developer", "content": "Answer in one word."},
                         {"role": "user", "content": [{"type": "text", "text": "Colour of the sky?"}]}],
            "temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "priority": None}
    req = JobCreate.model_validate(body)
    assert (req.temperature, req.top_p, req.top_k, req.n, req.stream, req.priority) == (0.0, 1.0, 0, 1, False, 5)
    stored = normalize_request(req, None, make_store(settings), settings)
    assert [m["role"] for m in stored["messages"]] == ["system", "user"]
    assert stored["sampling"]["temperature"] == 0.0 and stored["sampling"]["top_p"] == 1.0
    with pytest.raises(ValidationError):
        JobCreate.model_validate({**body, "n": 2})


def test_an_image_id_is_remembered_only_once_its_rows_are_committed(tmp_path: Path) -> None:
    """A request that stores an image as bytes and names it by id, then is refused, leaves no rows behind; the
    process must not remember the tenant as its owner, or a later job would skip the lookup."""
    settings = Settings(data_dir=tmp_path)
    upgrade(settings.database_url)
    db, store = get_database(settings.database_url), make_store(settings)
    image = png_bytes((9, 8, 7), size=(11, 13))
    image_id = "img_" + hashlib.sha256(image).hexdigest()
    refused = _request(data_url(image), image_id)
    refused.max_tokens = 10**9  # over the server's limit: refused after both images were resolved
    with pytest.raises(SubmissionError, match="max_tokens"), db.session() as session:
        normalize_request(refused, session, store, settings, tenant="acme")
    assert needs_session(_request(image_id), "acme")
    with db.session() as session:
        assert owned_image(session, "acme", image_id[4:]) is None
        with pytest.raises(SubmissionError, match="unknown image id"):
            normalize_request(_request(image_id), session, store, settings, tenant="acme")
    with db.session() as session:  # committed this time: remembered
        normalize_request(_request(data_url(image), image_id), session, store, settings, tenant="acme")
    assert not needs_session(_request(image_id), "acme")


def test_a_request_without_max_tokens_takes_the_models_default(tmp_path: Path) -> None:
    """Stored without max_tokens, a request gets the model's generation_config max_new_tokens where it sets one
    (the demo model: its answers are a few words), else VLMQ_DEFAULT_MAX_TOKENS; it used to get 256 whatever
    the model, and the demo model spent them on noise."""
    import json

    from worker.inference.model_loader import default_max_tokens
    from worker.jobs.request import JobImages, generation_request

    settings = Settings(data_dir=tmp_path, default_max_tokens=40, max_tokens_limit=100)
    stored = normalize_request(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]}), None, make_store(settings), settings)
    assert stored["sampling"]["max_tokens"] is None
    assert default_max_tokens("vlmq-demo", settings) == 6
    plain = tmp_path / "plain"
    plain.mkdir()
    assert default_max_tokens(str(plain), settings) == 40  # no generation_config.json
    (plain / "generation_config.json").write_text(json.dumps({"max_new_tokens": 500}))
    assert default_max_tokens(str(plain), settings) == 100  # never over the limit
    worker_settings = settings.model_copy(update={"default_max_tokens": 6})
    req = generation_request("job", stored, 5, worker_settings, JobImages([], 0), "acme")
    assert req.sampling.max_tokens == 6
    given = {**stored, "sampling": {**stored["sampling"], "max_tokens": 9}}
    assert generation_request("job", given, 5, worker_settings, JobImages([], 0), "acme").sampling.max_tokens == 9
