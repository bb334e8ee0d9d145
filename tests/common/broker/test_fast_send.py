"""run_job messages written directly into Redis (common/broker/fast_send.py) are the ones Celery writes, and a real
Celery worker runs them in priority order."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from common.broker.messages import live_job_ids
from common.broker.queue import (
    TASK_RUN_JOB,
    celery_priority,
    direct_sender,
    make_celery,
    run_job_args,
    send_run_jobs,
)
from common.infra.settings import Settings
from tests.redis_text import text


def _settings(redis_url: str) -> Settings:
    return Settings(broker_url=redis_url, model="/models/fast-send", auth="on")


def _lists(client: redis.Redis) -> dict[bytes, list[dict[str, Any]]]:
    return {key: [json.loads(m) for m in client.lrange(key, 0, -1)] for key in client.scan_iter()
            if client.type(key) == b"list"}


def _shape(value: Any) -> Any:
    """Keys and value types, recursively: what a consumer may rely on."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__


def test_direct_messages_match_celerys(redis_url: str) -> None:
    settings = _settings(redis_url)
    app = make_celery(settings)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    direct = direct_sender(app)
    assert direct is not None
    send_run_jobs(app, settings, ["job_direct"], 7)
    (key, (ours,)), = _lists(client).items()
    client.flushdb()
    app.send_task(TASK_RUN_JOB, args=["job_celery"], queue=settings.job_queue, priority=celery_priority(7))
    (celery_key, (theirs,)), = _lists(client).items()
    client.flushdb()
    assert key == celery_key == f"{settings.job_queue}\x06\x162".encode()
    assert _shape(ours) == _shape(theirs)
    body = base64.b64decode(ours["body"]).decode()
    assert body.replace("direct", "celery") == base64.b64decode(theirs["body"]).decode()
    assert ours["headers"]["argsrepr"] == "['job_direct']" and ours["headers"]["task"] == TASK_RUN_JOB
    for part in ("properties", "headers"):
        same = {k for k in theirs[part] if k not in ("id", "root_id", "correlation_id", "delivery_tag",
                                                     "reply_to", "argsrepr", "origin")}
        assert {k: ours[part][k] for k in same} == {k: theirs[part][k] for k in same}
    # The top priority (9) is Redis step 0: the bare queue name, as kombu names it.
    send_run_jobs(app, settings, ["job_top"], 9)
    assert list(_lists(client)) == [settings.job_queue.encode()]
    assert live_job_ids(redis_url) == {"job_top"}  # the republisher reads them
    client.flushdb()


def test_jobs_sent_together_share_messages_up_to_the_setting() -> None:
    ids = [f"j{i}" for i in range(7)]
    assert list(run_job_args(ids, 3)) == [[["j0", "j1", "j2"]], [["j3", "j4", "j5"]], ["j6"]]
    assert list(run_job_args(ids[:2], 16)) == [[["j0", "j1"]]]
    assert list(run_job_args(ids[:3], 1)) == [["j0"], ["j1"], ["j2"]]  # one job a message: the lone-id form
    assert list(run_job_args([], 16)) == []


def test_grouped_messages_match_celerys_and_the_republisher_reads_them(redis_url: str) -> None:
    settings = _settings(redis_url).model_copy(update={"job_ids_per_message": 4})
    app = make_celery(settings)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    assert send_run_jobs(app, settings, [f"job{i}" for i in range(10)], 7) == 10
    (_, messages), = _lists(client).items()
    args = [json.loads(base64.b64decode(m["body"]))[0] for m in messages]
    # LPUSH puts the first message sent last in the list (consumers BRPOP from the other end).
    assert args[::-1] == [[["job0", "job1", "job2", "job3"]], [["job4", "job5", "job6", "job7"]],
                          [["job8", "job9"]]]
    assert live_job_ids(redis_url) == {f"job{i}" for i in range(10)}
    client.flushdb()
    app.send_task(TASK_RUN_JOB, args=[["job0", "job1"]], queue=settings.job_queue, priority=celery_priority(7))
    (_, (theirs,)), = _lists(client).items()
    assert _shape(messages[0]) == _shape(theirs)
    assert live_job_ids(redis_url) == {"job0", "job1"}  # Celery's own envelope reads the same
    client.flushdb()


_WORKER = """
import sys
import redis
from common.broker.queue import TASK_RUN_JOB, make_celery
from common.infra.settings import Settings
settings = Settings(broker_url=sys.argv[1], model="/models/fast-send", auth="on")
app = make_celery(settings)
client = redis.Redis.from_url(sys.argv[1])

@app.task(name=TASK_RUN_JOB)
def run_job(job_ids):
    client.rpush("ran", *(job_ids if isinstance(job_ids, list) else [job_ids]))

app.worker_main(["worker", "-Q", settings.job_queue, "-P", "solo", "-c", "1", "--without-heartbeat",
                 "--without-mingle", "--without-gossip", "-l", "warning"])
"""


def test_a_celery_worker_runs_direct_messages_by_priority(redis_url: str) -> None:
    settings = _settings(redis_url)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    app = make_celery(settings)
    # Queued before the worker starts, so it sees them all and must pick by priority.
    send_run_jobs(app, settings, ["low-1", "low-2"], 2)
    send_run_jobs(app, settings, ["high-1", "high-2"], 8)
    send_run_jobs(app, settings, ["top"], 9)
    # A worker process of its own: a real consumer, untouched by Celery state other tests left in this one.
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, redis_url], cwd=Path(__file__).parents[3])
    try:
        deadline = time.monotonic() + 60
        while client.llen("ran") < 5 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.1)
        assert [text(m) for m in client.lrange("ran", 0, -1)] == ["top", "high-1", "high-2", "low-1", "low-2"]
    finally:
        worker.terminate()
        worker.wait(30)
        client.flushdb()


def test_other_brokers_go_through_celery() -> None:
    assert direct_sender(make_celery(Settings(model="/models/x"))) is None  # memory:// (embedded)

