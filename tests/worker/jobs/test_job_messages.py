"""run_job messages that carry several jobs, through a real Celery worker (threads pool) on Redis: the worker
holds no more jobs than its concurrency however they are grouped (worker/jobs/prefetch_share.py), runs each job
once, and sends again, in a message of their own, only the jobs that asked to be retried or whose run raised."""

from __future__ import annotations

import time
from types import SimpleNamespace

import redis
from kombu.common import QoS

from common.broker.queue import make_celery, send_run_jobs
from common.infra.settings import Settings
from tests import stub_worker
from tests.redis_text import text
from worker.jobs.prefetch_share import PrefetchShare


def test_a_worker_holds_its_concurrency_in_jobs_and_retries_only_what_asked(redis_url: str) -> None:
    settings = Settings(broker_url=redis_url, model=stub_worker.MODEL, job_ids_per_message=4)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    app = make_celery(settings)
    ids = [f"job{i}" for i in range(13)] + ["again0", "broken0", "again1"]
    send_run_jobs(app, settings, ids, 5)  # four messages of four jobs
    worker = stub_worker.start(redis_url, "held", 4)  # jobs "again*" retry once, "broken*" raise once
    try:
        deadline = time.monotonic() + 60
        while client.llen("ran") < 4 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # time enough for a worker that counts messages to take three more
        # Concurrency 4 and messages of 4: the first message holds all four slots.
        assert client.llen("ran") == 4
        client.set("go", 1)
        while client.llen("ran") < len(ids) + 3 and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)
        ran = [text(m) for m in client.lrange("ran", 0, -1)]
        assert sorted(ran) == sorted([*ids, "again0", "again1", "broken0"])  # each once, three once more
        # A message taken while its predecessor's last job runs may overshoot by its own size less one.
        assert int(client.get("most_running") or 0) <= 4 + 4 - 1
    finally:
        client.set("go", 1)  # a warm shutdown waits for the jobs it holds: let them end
        stub_worker.stop(worker)
        client.flushdb()


def _request(task_id: str, args: list[object], name: str = "vlmq.run_job") -> SimpleNamespace:
    return SimpleNamespace(id=task_id, name=name, args=args)


def test_prefetch_share_takes_slots_for_extra_jobs_and_gives_them_back() -> None:
    share = PrefetchShare()
    qos = QoS(lambda prefetch_count: None, 10)
    consumer = SimpleNamespace(qos=qos)
    share.on_task_received(sender=consumer, request=_request("a", [["j1", "j2", "j3", "j4"]]))
    assert qos.value == 7 and share.taken("a") == 3
    share.on_task_received(sender=consumer, request=_request("lone", ["j5"]))  # a lone job: its message's slot
    share.on_task_received(sender=consumer, request=_request("other", [["x", "y"]], name="vlmq.ingest_batch"))
    assert qos.value == 7
    share.give_back("a", 1)
    assert qos.value == 8 and share.taken("a") == 2
    share.give_back("a")
    assert qos.value == 10 and share.taken("a") == 0
    share.give_back("a", 1)  # nothing left: no slot made up
    assert qos.value == 10


def test_prefetch_share_never_drops_the_count_below_one_nor_returns_more_than_it_took() -> None:
    share = PrefetchShare()
    qos = QoS(lambda prefetch_count: None, 3)
    consumer = SimpleNamespace(qos=qos)
    share.on_task_received(sender=consumer, request=_request("big", [[f"j{i}" for i in range(16)]]))
    assert qos.value == 1 and share.taken("big") == 2
    share.on_task_received(sender=consumer, request=_request("next", [["a", "b"]]))
    assert qos.value == 1 and share.taken("next") == 0
    for _ in range(16):
        share.give_back("big", 1)
    share.give_back("next")
    assert qos.value == 3
    unlimited = QoS(lambda prefetch_count: None, 0)  # prefetch off: nothing to share
    share.on_task_received(sender=SimpleNamespace(qos=unlimited), request=_request("u", [["a", "b"]]))
    assert unlimited.value == 0 and share.taken("u") == 0
