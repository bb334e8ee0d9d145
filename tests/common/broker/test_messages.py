"""The republisher's view of Redis: which jobs have a run_job message, and resending those that lost theirs."""

from __future__ import annotations

import base64
import time
import uuid
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select

from common.broker import dispatch
from common.broker.messages import BrokerNotInspectable, _job_ids, live_job_ids
from common.broker.queue import make_celery, model_sender
from common.domain import jobs
from common.domain.models import Job
from common.infra.db import Database
from common.infra.settings import Settings
from tests.redis_text import text


def test_live_ids_cover_queued_and_unacked_messages_and_lost_ones_are_resent(db: Database, redis_url: str) -> None:
    model = f"m-{uuid.uuid4().hex[:6]}"
    # Two jobs to a message: messages of [2, 2, 1] jobs.
    settings = Settings(broker_url=redis_url, served_model_name=model, job_ids_per_message=2)
    app = make_celery(settings)
    send = model_sender(app, settings)
    with db.session() as session:
        ids = [jobs.create_job(session, model=model, request={}, tenant="t", dispatched=False).id for _ in range(5)]
    assert dispatch.top_up(db, "t", model, 10, send) == 5
    client = redis.Redis.from_url(redis_url)
    live = live_job_ids(redis_url)
    assert set(ids) <= live
    # A worker took the first message (kombu moves it to the `unacked` hash until the ack): still live.
    queue = settings.job_queue
    keys = [k for k in client.keys(queue + "*") if text(k).startswith(queue)]
    assert keys
    raw = client.rpop(keys[0])
    assert isinstance(raw, bytes)
    client.hset("unacked", "delivery-tag-1", b'[' + raw + b', "", "' + queue.encode() + b'"]')
    client.zadd("unacked_index", {"delivery-tag-1": time.time() - 30})
    assert set(ids) <= live_job_ids(redis_url)
    assert set(ids) <= live_job_ids(redis_url, unacked_max_age=60)
    # Unacked for longer than the republisher's grace: its worker may be dead, so the job counts as lost.
    taken = set(ids) - live_job_ids(redis_url, unacked_max_age=10)
    assert len(taken) == 2 and taken < set(ids)  # both jobs of that message
    # Redis restarted without persistence: every message is gone.
    client.delete(*keys)
    client.hdel("unacked", "delivery-tag-1")
    client.zrem("unacked_index", "delivery-tag-1")
    assert not set(ids) & live_job_ids(redis_url)
    assert dispatch.lost_messages(db, live_job_ids(redis_url), timedelta(hours=1)) == []  # within the grace
    lost = dispatch.lost_messages(db, live_job_ids(redis_url), timedelta(0))
    assert sorted(lost) == sorted(ids)
    assert dispatch.top_up_all(db, 10, send) >= 5
    assert set(ids) <= live_job_ids(redis_url)
    with db.session() as session:
        assert all(session.scalars(select(Job.dispatched_at).where(Job.id.in_(ids))))
    client.delete(*[k for k in client.keys(queue + "*") if text(k).startswith(queue)])


def test_only_redis_can_be_listed() -> None:
    with pytest.raises(BrokerNotInspectable):
        live_job_ids("memory://")


@pytest.mark.parametrize("body", [b'[["job-1"], {}, {}]', b'[[["job-1", "job-2"]], {}, {}]', b'[[], {}, {}]',
                                  b'[{"a": 1}, {}, {}]', b'[[{"x": 1}], {}]', b'not json', b'{}'])
def test_any_body_reads_as_its_job_ids_or_none(body: bytes) -> None:
    message = {"headers": {"task": "vlmq.run_job"}, "body": base64.b64encode(body).decode(),
               "properties": {"body_encoding": "base64"}}
    expected = {b'[["job-1"], {}, {}]': ["job-1"], b'[[["job-1", "job-2"]], {}, {}]': ["job-1", "job-2"]}
    assert _job_ids(message) == expected.get(body, [])  # anything else, ours or not, names no job
