"""worker/tasks.py: the Celery tasks, bound to the app they were registered on."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery.worker import state as worker_state

from common.broker.queue import TASK_RUN_JOB, TASK_SWEEP_BATCHES, make_celery, send_check_leases
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from worker.context import current_context, set_context
from worker.embedded import _ThreadWorker
from worker.tasks import register_tasks


def test_each_app_runs_its_own_tasks_against_its_own_settings(tmp_path: Path) -> None:
    """Two apps in one process (tests, an embedded run beside another): the second app's sweep reads the
    second app's database. Celery's default shared tasks were registered on every later app too, and the
    first registration won, so the second app's sweep ran against the first app's database."""
    first = Settings(data_dir=tmp_path / "first")  # no schema: a sweep that reached it would fail
    second = Settings(data_dir=tmp_path / "second")
    upgrade(second.database_url)
    first_app, second_app = make_celery(first), make_celery(second)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Celery warns when a task name is registered twice on one app
        register_tasks(first_app)
        register_tasks(second_app)
        swept = second_app.tasks[TASK_SWEEP_BATCHES].apply()
    assert swept.successful(), swept.traceback
    assert swept.result == 0
    failed = first_app.tasks[TASK_SWEEP_BATCHES].apply()
    assert failed.failed() and "no such table" in str(failed.result)


def test_a_task_answers_to_its_own_app_from_any_thread(tmp_path: Path) -> None:
    """The tasks are module-level functions that find their app through `task.app`: each app gets task classes
    of its own, bound to it, whichever app is current in the thread that runs them (the embedded worker's)."""
    first, second = (make_celery(Settings(data_dir=tmp_path / name)) for name in ("first", "second"))
    register_tasks(first)
    register_tasks(second)
    seen: dict[str, object] = {}

    def look() -> None:
        make_celery(Settings(data_dir=tmp_path / "third")).set_current()
        seen["first"], seen["second"] = first.tasks[TASK_RUN_JOB].app, second.tasks[TASK_RUN_JOB].app

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    assert seen == {"first": first, "second": second}
    assert type(first.tasks[TASK_RUN_JOB]) is not type(second.tasks[TASK_RUN_JOB])


class _Keeper:
    def __init__(self) -> None:
        self.asked = threading.Event()

    def check_soon(self) -> None:
        self.asked.set()


@pytest.mark.parametrize("broker", ["memory", "redis"])
def test_a_cancel_tells_every_worker_to_look_at_its_leases(broker: str, tmp_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    """The broadcast a cancel of running jobs sends (common/broker/queue.send_check_leases) reaches a running
    worker through the broker, the in-process one of embedded mode and Redis alike, and has its lease keeper
    look at once which jobs it still holds."""
    url = "memory://" if broker == "memory" else request.getfixturevalue("redis_url")
    settings = Settings(data_dir=tmp_path, broker_url=url)
    app = make_celery(settings)
    register_tasks(app)
    worker = _ThreadWorker(app=app, concurrency=1, pool="threads", queues=[settings.job_queue],
                           hostname=f"check-leases-{broker}@localhost", loglevel="WARNING", without_heartbeat=True,
                           without_mingle=True, without_gossip=True)
    thread = threading.Thread(target=worker.start, daemon=True)
    keeper, before = _Keeper(), current_context()
    set_context(SimpleNamespace(leases=keeper))  # type: ignore[arg-type]
    thread.start()
    try:
        assert worker.ready.wait(30)
        sender = make_celery(settings)  # another process's app: the cancel task's
        # A broadcast is not kept for a worker that is not listening yet (on Redis, its control queue is
        # subscribed to just after the worker says it is ready): sent again until heard, as a later cancel would be.
        for _ in range(40):
            send_check_leases(sender)
            if keeper.asked.wait(0.5):
                break
        assert keeper.asked.is_set()
    finally:
        set_context(before)
        worker_state.should_terminate = 0
        thread.join(30)
        worker_state.should_terminate = None
    assert not thread.is_alive()
