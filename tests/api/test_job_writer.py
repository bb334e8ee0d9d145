"""The group-commit writer of POST /v1/jobs, driven directly on SQLite: one transaction for many jobs, and a
request whose client went away is skipped without stopping the writer."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from pathlib import Path

from sqlalchemy import func, select

from api.job_writer import JobWriter, _Pending
from api.main import create_app
from common.models import Job
from common.settings import Settings

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
           "sampling": {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}}


def test_writer_commits_together_and_survives_abandoned_requests(tmp_path: Path) -> None:
    from common.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    app = create_app(Settings(data_dir=tmp_path, database_url=url, model="tiny", broker_url="memory://"))
    writer: JobWriter = app.state.job_writer
    abandoned: Future[str] = Future()
    abandoned.cancel()  # its client disconnected before the writer got to it
    writer._ensure_started()
    writer._queue.put(_Pending({"model": "tiny", "request": REQUEST, "tenant": "t"}, abandoned))

    async def submit_many() -> list[str]:
        return await asyncio.gather(*(writer.write({"model": "tiny", "request": REQUEST, "tenant": "t",
                                                    "metadata": {"i": str(i)}}) for i in range(20)))

    views = asyncio.run(submit_many())
    assert len({v for v in views}) == 20
    with app.state.vlmq.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 20  # the abandoned one is not written
    writer.close()
    app.state.vlmq.db.dispose()
