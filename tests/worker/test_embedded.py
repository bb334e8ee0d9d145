"""worker/embedded.py: what an embedded process takes over from the one before it in the same data folder."""

from __future__ import annotations

from pathlib import Path

import kombu

from common.broker.queue import TASK_INGEST_BATCH, ingest_queue, make_celery
from common.domain import batches
from common.infra.db import get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from worker.embedded import resume_ingestions


def test_batches_left_validating_get_their_ingestion_sent_again(tmp_path: Path) -> None:
    """Their ingest_batch messages died with the earlier process's in-memory broker: `vlmq api` sends them
    again at start, so they do not wait unread until their window expires."""
    settings = Settings(data_dir=tmp_path)
    upgrade(settings.database_url)
    db = get_database(settings.database_url)
    with db.session() as session:
        left = [batches.create_batch(session, input_file_id=f"file-{i}", endpoint="/v1/chat/completions",
                                     completion_window="24h", model="m", metadata=None).id for i in range(2)]
        started = batches.create_batch(session, input_file_id="file-x", endpoint="/v1/chat/completions",
                                       completion_window="24h", model="m", metadata=None).id
        assert batches.start(session, started)
    assert resume_ingestions(make_celery(settings), settings) == 2
    with kombu.Connection("memory://") as connection:
        queue = connection.SimpleQueue(ingest_queue(settings))
        sent = []
        while queue.qsize():
            message = queue.get(timeout=5)
            sent.append((message.headers["task"], message.headers["argsrepr"]))
            message.ack()
    assert sorted(sent) == sorted((TASK_INGEST_BATCH, repr([batch_id])) for batch_id in left)
