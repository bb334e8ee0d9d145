"""common/infra/debounce.py: follow-up work runs at most once per interval per key, on its own thread, and always
once more after the last request."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from common.infra.debounce import Debouncer


def test_a_lone_request_runs_at_once_on_the_background_thread() -> None:
    debouncer = Debouncer(interval=5.0)
    ran: list[str] = []
    start = time.monotonic()
    assert debouncer.request("k", lambda: ran.append(threading.current_thread().name)) is True
    assert debouncer.wait_idle(5)
    assert ran == ["vlmq-debounce"]
    assert time.monotonic() - start < 2.0  # not held back by the 5 s interval


def test_a_burst_runs_once_per_interval_and_once_after_the_last_request() -> None:
    interval = 0.2
    debouncer = Debouncer(interval)
    starts: list[float] = []
    requests: list[float] = []
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # ~1,000 requests over one second, as jobs ending in a busy worker
        requests.append(time.monotonic())
        debouncer.request("k", lambda: starts.append(time.monotonic()))
        time.sleep(0.001)
    assert debouncer.wait_idle(5)
    # One second of requests at most every 0.2 s: 5 runs plus the trailing one, not one per request.
    assert 2 <= len(starts) <= 7
    assert all(b - a >= interval * 0.99 for a, b in itertools.pairwise(starts))
    assert starts[-1] >= requests[-1]  # the last request was covered by a run that began after it


def test_a_request_during_a_run_earns_exactly_one_more_run() -> None:
    debouncer = Debouncer(interval=0.05)
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def slow() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            started.set()
            release.wait(10)

    debouncer.request("k", slow)
    assert started.wait(5)
    # Five requests while the first run is in progress: one pending run covers them all.
    assert [debouncer.request("k", slow) for _ in range(5)] == [True, False, False, False, False]
    release.set()
    assert debouncer.wait_idle(5)
    assert runs == [0, 1]


def test_the_latest_work_of_a_key_is_the_one_that_runs() -> None:
    debouncer = Debouncer(interval=0.3)
    ran: list[str] = []
    debouncer.request("k", lambda: ran.append("first"))
    assert debouncer.wait_idle(5)
    debouncer.request("k", lambda: ran.append("second"))  # within the interval: pending
    debouncer.request("k", lambda: ran.append("third"))
    assert debouncer.wait_idle(5)
    assert ran == ["first", "third"]


def test_keys_do_not_wait_for_each_other() -> None:
    debouncer = Debouncer(interval=2.0)
    done = threading.Event()
    debouncer.request("a", lambda: None)
    assert debouncer.wait_idle(5)
    debouncer.request("a", lambda: None)  # due in 2 s
    start = time.monotonic()
    debouncer.request("b", done.set)
    assert done.wait(5)
    assert time.monotonic() - start < 1.0


def test_an_error_is_logged_and_the_key_runs_again_later(caplog: pytest.LogCaptureFixture) -> None:
    debouncer = Debouncer(interval=0.01)

    def boom() -> None:
        raise ValueError("boom")

    debouncer.request("k", boom)
    assert debouncer.wait_idle(5)
    assert "follow-up work 'k' failed" in caplog.text
    ran = threading.Event()
    debouncer.request("k", ran.set)
    assert ran.wait(5)


def test_wait_idle_times_out_while_work_runs() -> None:
    debouncer = Debouncer(interval=0.01)
    release = threading.Event()
    debouncer.request("k", lambda: release.wait(10))
    assert debouncer.wait_idle(0.2) is False
    release.set()
    assert debouncer.wait_idle(5) is True


def test_a_forked_child_runs_its_own_requests() -> None:
    debouncer = Debouncer(interval=0.01)
    debouncer.request("k", lambda: None)  # the parent's thread exists before the fork
    assert debouncer.wait_idle(5)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's survives; a request must still run
        try:
            debouncer.request("k", lambda: os.write(write_end, b"ran"))
            os._exit(0 if debouncer.wait_idle(5) else 1)
        finally:
            os._exit(1)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 16) == b"ran"
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_request_made_now_skips_the_interval_and_runs_once() -> None:
    debouncer = Debouncer(interval=5.0)
    ran: list[str] = []
    debouncer.request("k", lambda: ran.append("first"))
    assert debouncer.wait_idle(5)
    assert debouncer.request("k", lambda: ran.append("held")) is True  # due in 5 s
    start = time.monotonic()
    assert debouncer.request("k", lambda: ran.append("now"), now=True) is False  # the pending run, made sooner
    assert debouncer.wait_idle(2)
    assert time.monotonic() - start < 1.0
    assert ran == ["first", "now"]
    time.sleep(0.2)  # the stale entry of the held run, due in 5 s, must not run anything later
    assert ran == ["first", "now"]
    # After a run made now, plain requests wait out the interval again.
    debouncer.request("k", lambda: ran.append("later"))
    assert not debouncer.wait_idle(0.3)
