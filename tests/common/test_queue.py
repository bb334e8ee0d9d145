"""common/queue.py: where tasks go."""

from __future__ import annotations

from pathlib import Path

import kombu

from common.queue import INGEST_QUEUE, TASK_FINALIZE_BATCH, ingest_queue, make_celery, send_finalize_batch
from common.settings import Settings


def test_embedded_setups_in_one_process_keep_their_batch_tasks_apart(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
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
