"""common/broker/queue.py: where tasks go."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import kombu
import pytest

from common.broker.queue import INGEST_QUEUE, TASK_FINALIZE_BATCH, ingest_queue, make_celery, send_finalize_batch
from common.infra.settings import Settings


def test_embedded_setups_in_one_process_keep_their_batch_tasks_apart(tmp_path: Path, monkeypatch) -> None:
    """The memory broker's queues belong to the whole process: two embedded setups (two data folders) each
    get a batch-task queue of their own, the same one however the folder is spelled; with a real broker,
    every ingest worker shares `ingest`."""
    first, second = Settings(data_dir=tmp_path / "a"), Settings(data_dir=tmp_path / "b")
    monkeypatch.chdir(tmp_path)
    assert ingest_queue(first) == ingest_queue(Settings(data_dir=Path("a"))) != ingest_queue(second)
    assert ingest_queue(Settings(broker_url="redis://127.0.0.1:6379/0", data_dir=tmp_path)) == INGEST_QUEUE
    app = make_celery(first)
    send_finalize_batch(app, first, "batch_x")
    with kombu.Connection("memory://") as connection:
        theirs = connection.SimpleQueue(ingest_queue(second))
        ours = connection.SimpleQueue(ingest_queue(first))
        assert theirs.qsize() == 0
        message = ours.get(timeout=5)
        assert message.headers["task"] == TASK_FINALIZE_BATCH
        message.ack()


def test_an_idle_embedded_consumer_takes_a_message_at_once(tmp_path: Path) -> None:
    """The in-process broker is polled: with kombu's default interval an idle consumer slept a second between
    polls, and a run's first jobs, its finalize and the worker's stop each waited for it."""
    settings = Settings(data_dir=tmp_path)
    app = make_celery(settings)
    sent: list[float] = []
    received: list[float] = []

    def send() -> None:
        sent.append(time.monotonic())
        send_finalize_batch(app, settings, "batch_x")

    def take(body: object, message: kombu.Message) -> None:
        received.append(time.monotonic())
        message.ack()

    with app.connection_for_read() as connection, connection.Consumer(
            kombu.Queue(ingest_queue(settings)), callbacks=[take], accept=["json"]):
        timer = threading.Timer(0.3, send)
        timer.start()
        connection.drain_events(timeout=5)
        timer.join()
    assert received and received[0] - sent[0] < 0.25, (sent, received)


def test_an_idle_embedded_worker_stops_at_once(tmp_path: Path) -> None:
    """Celery's loop for the in-process broker looked for a stop only between drains of up to two seconds, and
    every `vlmq run` waited that long at its end (common/broker/embedded_transport.py)."""
    from concurrent.futures import Future

    from common.infra.migrate import upgrade
    from worker.embedded import embedded_worker

    settings = Settings(data_dir=tmp_path, model="not-loaded")
    upgrade(settings.database_url)
    loaded: Future[None] = Future()
    loaded.set_result(None)  # the worker takes no job here: its model is never needed
    with embedded_worker(make_celery(settings), settings, model_loaded=loaded):
        time.sleep(0.5)  # idle, inside a drain
        asked = time.monotonic()
    assert time.monotonic() - asked < 1.0


def test_telling_the_workers_logs_a_broker_that_cannot_take_it(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The cancel is in SQL already: a broadcast the broker refuses is logged, never raised to the cancel's
    caller (the workers' heartbeats find the jobs)."""
    from common.broker import queue

    def refused(app: object) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(queue, "send_check_leases", refused)
    queue.tell_workers_to_check_leases(queue.make_celery(Settings(model="/models/x")), "batch batch_x")
    assert "could not tell the workers that batch batch_x was cancelled" in caplog.text
