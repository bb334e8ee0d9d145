"""The group-commit writer of POST /v1/jobs, driven directly on SQLite: one transaction for many jobs, and a
request whose client went away is skipped without stopping the writer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api.job_writer import JobWriter
from api.main import create_app
from common.domain.jobs import NewJob
from common.domain.models import Job
from common.infra.group_commit import Pending
from common.infra.settings import Settings

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling": {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}}


def test_writer_commits_together_and_survives_abandoned_requests(tmp_path: Path) -> None:
    from common.infra.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    app = create_app(Settings(data_dir=tmp_path, database_url=url, model="tiny", broker_url="memory://"))
    writer: JobWriter = app.state.job_writer
    abandoned: Pending[NewJob, str] = Pending(NewJob(model="tiny", request=REQUEST, tenant="t"))
    abandoned.cancel()  # its client disconnected before the writer got to it
    writer.committer._queue.put(abandoned)

    async def submit_many() -> list[str]:
        return await asyncio.gather(*(writer.write(NewJob(model="tiny", request=REQUEST, tenant="t",
                                                           metadata={"i": str(i)})) for i in range(20)))

    views = asyncio.run(submit_many())
    assert len({v for v in views}) == 20
    with app.state.vlmq.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 20  # the abandoned one is not written
    writer.close()
    app.state.vlmq.db.dispose()


def test_one_unwritable_request_fails_alone_in_its_group(tmp_path: Path) -> None:
    """A request the database or the view cannot take (here metadata no JSON writer accepts, which the API's
    edge refuses but the writer must not rely on) fails on its own; its group's other requests are written."""
    from common.infra.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    app = create_app(Settings(data_dir=tmp_path, database_url=url, model="tiny", broker_url="memory://"))
    writer: JobWriter = app.state.job_writer
    # Asked for together, before the writer thread starts: one group of nine.
    answers = writer.committer.submit_all(
        NewJob(model="tiny", request=REQUEST, tenant="t", metadata={"i": "bad\udc00"} if i == 4 else {"i": str(i)})
        for i in range(9))
    for i, answer in enumerate(answers):
        if i == 4:
            with pytest.raises(Exception):  # noqa: B017 - whatever the serializer raises, it reaches this request
                answer.result(timeout=30)
        else:
            assert json.loads(answer.result(timeout=30))["metadata"] == {"i": str(i)}
    with app.state.vlmq.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 8
    writer.close()
    app.state.vlmq.db.dispose()
