"""Durability with real processes: workers killed, the broker and the database restarted, S3 gone away, a crash
between the result write and the SQL commit, a poison job. After each, every accepted job is in exactly one
terminal state with exactly one result object, and no job ran more attempts than allowed.

The stack (tests/fault_stack.py) has its own redis-server and Postgres cluster on spare ports, and reaches
the S3 server through a proxy that can refuse connections: what these tests break is theirs alone. Leases,
heartbeats and the sweep are short, so each scenario runs in seconds.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fault_stack import FaultStack, Process, Report, wait_for

N_JOBS = 24
MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def stack(s3_endpoint: str, tiny_llava_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    fault_stack = FaultStack(
        tmp_path_factory.mktemp("faults"), s3_endpoint, tiny_llava_path,
        lease_seconds=4, heartbeat_seconds=1, max_attempts=MAX_ATTEMPTS, retry_backoff_seconds=0.5,
        sweep_interval_seconds=1, republish_grace_seconds=2, broker_visibility_timeout=3600,
        # Two sequences decode at a time, so a run of 24 jobs lasts long enough to be broken halfway.
        max_num_seqs=2, worker_concurrency=4, device="cpu", dtype="float32", stats_interval_seconds=1,
    )
    try:
        yield fault_stack.start()
    finally:
        fault_stack.close()


@pytest.fixture
def workers(stack: FaultStack) -> Iterator[list[Process]]:
    """Workers a test starts; whatever is left of them is killed afterwards, so the next test starts clean."""
    started: list[Process] = []
    yield started
    for worker in started:
        worker.signal(signal.SIGKILL)
        worker.proc.wait(20)


def start_worker(stack: FaultStack, workers: list[Process], faults: str = "", **env: str) -> Process:
    worker = stack.worker(4, faults, **env)
    workers.append(worker)
    stack.wait_worker_ready(worker)
    return worker


def prompts(tag: str, n: int = N_JOBS) -> list[str]:
    return [f"{tag} job {i}: describe something" for i in range(n)]


def wait_some_done(stack: FaultStack, job_ids: list[str], at_least: int = 4) -> None:
    wait_for(lambda: stack.count(job_ids, "succeeded") >= at_least, 120, f"{at_least} jobs to succeed")


def wait_supervised(stack: FaultStack, workers: list[Process], job_ids: list[str], timeout: float,
                    faults: str = "") -> int:
    """Wait for every job to end, restarting a worker that exits, as compose's `restart: unless-stopped`
    does; returns how many restarts it took. A restarted worker is not waited on to log readiness: it may
    take a redelivered poison job and die before it logs it, and then it is simply restarted again."""
    restarts = 0
    deadline = time.monotonic() + timeout
    while stack.count(job_ids, "succeeded", "failed", "dead", "cancelled") != len(job_ids):
        assert time.monotonic() < deadline, stack.statuses(job_ids)
        if not workers[-1].alive():
            restarts += 1
            workers.append(stack.worker(faults=faults))
        time.sleep(0.25)
    return restarts


def assert_all_succeeded_once(report: Report, n: int = N_JOBS) -> None:
    assert report.statuses == {"succeeded": n}, report
    assert report.clean, report


def test_sigkill_of_the_worker_mid_run(stack: FaultStack, workers: list[Process]) -> None:
    """The threads pool runs jobs in the worker process itself: killing its pool is killing the process."""
    first = start_worker(stack, workers)
    job_ids = stack.submit(prompts("sigkill"))
    wait_some_done(stack, job_ids)
    first.signal(signal.SIGKILL)
    assert stack.count(job_ids, "succeeded") < N_JOBS  # it died with work in hand
    start_worker(stack, workers)
    stack.wait_terminal(job_ids, 120)
    report = stack.report(job_ids)
    assert_all_succeeded_once(report)
    assert max(report.attempts) == 2  # the jobs it held ran again, once


def test_sigkill_mid_chunk_of_batch_rows(stack: FaultStack, workers: list[Process]) -> None:
    """Batch rows come many to a message and run as one chunk (worker/jobs/chunk_runner.py): a worker killed with a
    chunk half done loses only its unfinished rows' work, which runs again; no row gets two results, and the
    batch still completes with every row in its output."""
    first = start_worker(stack, workers)
    batch_id, job_ids = stack.submit_batch(prompts("chunk"))
    wait_some_done(stack, job_ids)
    first.signal(signal.SIGKILL)
    assert stack.count(job_ids, "succeeded") < N_JOBS  # it died with rows of a chunk in hand
    start_worker(stack, workers)
    stack.wait_terminal(job_ids, 120)
    report = stack.report(job_ids)
    assert_all_succeeded_once(report)
    assert max(report.attempts) == 2  # the rows it held ran again, once
    wait_for(lambda: stack.batch_status(batch_id) == "completed", 60, "the batch to complete")


def test_sigterm_mid_run_finishes_what_it_holds(stack: FaultStack, workers: list[Process]) -> None:
    first = start_worker(stack, workers)
    job_ids = stack.submit(prompts("sigterm"))
    wait_some_done(stack, job_ids)
    first.signal(signal.SIGTERM)
    first.proc.wait(60)  # a warm shutdown: it ends the jobs it runs, gives back the messages it only holds
    start_worker(stack, workers)
    stack.wait_terminal(job_ids, 120)
    report = stack.report(job_ids)
    assert_all_succeeded_once(report)
    assert set(report.attempts) == {1}  # nothing it was running was lost


def test_jobs_that_outlive_the_visibility_timeout_run_once(stack: FaultStack, workers: list[Process]) -> None:
    """Redis hands an unacked message to another worker after the visibility timeout, although the first one
    still runs it: the lease makes the second delivery a no-op."""
    fast_redelivery = {"VLMQ_BROKER_VISIBILITY_TIMEOUT": "1"}
    first = start_worker(stack, workers, **fast_redelivery)
    second = start_worker(stack, workers, **fast_redelivery)
    job_ids = stack.submit(prompts("visibility"), max_tokens=48)
    stack.wait_terminal(job_ids, 180)
    report = stack.report(job_ids)
    assert_all_succeeded_once(report)
    assert set(report.attempts) == {1}
    redelivered = sum(w.tail(2_000_000).count("'skipped'") for w in (first, second))
    assert redelivered > 0, "no message was delivered twice: the scenario did not happen"


def test_redis_restarted_without_persistence(stack: FaultStack, workers: list[Process]) -> None:
    start_worker(stack, workers)
    job_ids = stack.submit(prompts("redis"))
    wait_some_done(stack, job_ids)
    stack.redis.restart(down_seconds=1)  # comes back empty: every queued message is gone
    assert wait_supervised(stack, workers, job_ids, 180) == 0  # the worker reconnected: nothing restarted it
    assert_all_succeeded_once(stack.report(job_ids))
    with stack.api.client() as client:  # the API reconnects too
        assert client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "after"}],
                                             "max_tokens": 2}).status_code == 202


def test_every_process_rides_out_repeated_redis_restarts(stack: FaultStack, workers: list[Process]) -> None:
    """Redis restarted three times empty, then once keeping its data (AOF): the model worker and the
    maintenance process (`ingest-worker --beat`) reconnect and go on, none exits. Each restart comes while the
    worker runs fewer jobs than its concurrency: it holds their messages unacked and waits on the broker for
    more, the state in which kombu's AttributeError on the reconnect stopped it (with status 0)."""
    worker = start_worker(stack, workers)
    maintenance, restarts = stack.maintenance, stack.maintenance_restarts
    job_ids: list[str] = []
    for i, appendonly in enumerate([False, False, True, True]):
        stack.redis.appendonly = appendonly  # the first AOF restart comes back empty, the second replays it
        ids = stack.submit(prompts(f"restart {i}", 2), max_tokens=64)
        wait_for(lambda ids=ids: stack.count(ids, "running", "succeeded") or not worker.alive(), 60, "a job to run")
        assert worker.alive(), f"the worker exited with {worker.proc.returncode} after restart {i - 1}"
        job_ids += ids
        stack.redis.restart(down_seconds=1)
        time.sleep(2)  # the processes notice the restart before the next one
    stack.redis.appendonly = False
    assert worker.alive(), f"the worker exited with {worker.proc.returncode} after the last restart"
    job_ids += stack.submit(prompts("after the restarts", 6))
    stack.wait_terminal(job_ids, 180)
    assert_all_succeeded_once(stack.report(job_ids), len(job_ids))
    assert worker.alive(), worker.tail()
    assert stack.maintenance is maintenance and stack.maintenance_restarts == restarts, maintenance.tail()
    for process in (worker, maintenance):
        assert "Unrecoverable error" not in process.tail(2_000_000)


def test_postgres_restarted_mid_run(stack: FaultStack, workers: list[Process]) -> None:
    start_worker(stack, workers)
    job_ids = stack.submit(prompts("postgres"))
    wait_some_done(stack, job_ids)
    stack.postgres.stop()  # as a crash: no shutdown checkpoint
    try:
        with stack.api.client(timeout=30) as client:
            during = [client.get(f"/v1/jobs/{job_ids[0]}"),
                      client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "x"}]})]
        time.sleep(2)
    finally:
        stack.postgres.start()
    for response in during:
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) > 0
        assert response.json()["error"]["message"]
    stack.wait_terminal(job_ids, 180)
    assert_all_succeeded_once(stack.report(job_ids))


def test_s3_down_then_up(stack: FaultStack, workers: list[Process]) -> None:
    start_worker(stack, workers)
    job_ids = stack.submit(prompts("s3"))
    wait_some_done(stack, job_ids)
    stack.s3.down()
    try:
        time.sleep(4)  # longer than the in-place retries of a blip: results wait for S3, attempts are kept
    finally:
        stack.s3.up()
    stack.wait_terminal(job_ids, 180)
    report = stack.report(job_ids)
    assert_all_succeeded_once(report)
    assert set(report.attempts) == {1}


def test_crash_between_the_s3_write_and_the_sql_commit(stack: FaultStack, workers: list[Process],
                                                       tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    crashing = stack.worker(faults=f"crash_after_persist:{marker}")
    workers.append(crashing)
    job_ids = stack.submit(prompts("persist", 12))
    wait_for(lambda: marker.exists() and not crashing.alive(), 120, "the injected crash")
    crashed_job = marker.read_text()
    assert crashed_job in job_ids
    start_worker(stack, workers)
    stack.wait_terminal(job_ids, 120)
    report = stack.report(job_ids)  # its result object was written twice under one key, and agrees with SQL
    assert_all_succeeded_once(report, 12)
    assert stack.statuses([crashed_job]) == {"succeeded": 1}


def test_a_poison_job_ends_dead_and_the_others_flow(stack: FaultStack, workers: list[Process]) -> None:
    """The poison kills whichever worker runs it. Each time, the jobs beside it lose an attempt too; a last
    attempt runs alone (worker/jobs/solo_gate.py), so only the poison uses all of its attempts up."""
    poison = "poison"
    start_worker(stack, workers, faults=f"poison:{poison}")
    texts = prompts("flow", 15)
    texts.insert(5, f"{poison} pill")
    job_ids = stack.submit(texts)
    poison_id = job_ids[5]
    wait_supervised(stack, workers, job_ids, 240, faults=f"poison:{poison}")
    report = stack.report(job_ids)
    assert report.statuses == {"succeeded": 15, "dead": 1}, report
    assert report.clean, report
    from common.domain.models import Job

    with stack._db().session() as session:
        dead = session.get(Job, poison_id)
        assert dead is not None and dead.status == "dead" and dead.attempts == MAX_ATTEMPTS
        assert dead.error_code == "lease_expired"
    assert sum(1 for w in workers if w.proc.returncode == -signal.SIGKILL) == MAX_ATTEMPTS


def test_every_scenario_left_the_api_answering(stack: FaultStack) -> None:
    with httpx.Client(base_url=stack.api.url, headers=stack.api.headers, timeout=30) as client:
        assert client.get("/readyz").status_code == 200
