"""worker/inference/pixel_budget.py: decoded pixels held at once by a worker's job threads."""

from __future__ import annotations

import threading
import time

from worker.inference.pixel_budget import PixelBudget


def _hold_in_thread(budget: PixelBudget, pixels: int, log: list[str], name: str, release: threading.Event
                    ) -> threading.Thread:
    def run() -> None:
        with budget.hold(pixels):
            log.append(name)
            release.wait(10)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_holders_fit_in_the_budget_and_waiters_go_in_arrival_order() -> None:
    budget = PixelBudget(100)
    log: list[str] = []
    first_done, big_done, small_done = threading.Event(), threading.Event(), threading.Event()
    first = _hold_in_thread(budget, 60, log, "first", first_done)
    _wait_for(lambda: log == ["first"])
    big = _hold_in_thread(budget, 70, log, "big", big_done)  # does not fit beside the first
    _wait_for(lambda: len(budget._waiting) == 1)
    small = _hold_in_thread(budget, 10, log, "small", small_done)  # would fit, but arrived after the big one
    _wait_for(lambda: len(budget._waiting) == 2)
    time.sleep(0.1)
    assert log == ["first"] and budget.num_held == 60
    first_done.set()
    _wait_for(lambda: log == ["first", "big", "small"])
    assert budget.num_held == 80
    big_done.set()
    small_done.set()
    for thread in (first, big, small):
        thread.join(5)
    assert budget.num_held == 0 and not budget._waiting


def test_a_job_larger_than_the_budget_runs_alone_and_text_jobs_never_wait() -> None:
    budget = PixelBudget(100)
    log: list[str] = []
    small_done, huge_done = threading.Event(), threading.Event()
    small = _hold_in_thread(budget, 10, log, "small", small_done)
    _wait_for(lambda: log == ["small"])
    huge = _hold_in_thread(budget, 500, log, "huge", huge_done)
    _wait_for(lambda: len(budget._waiting) == 1)
    with budget.hold(0):  # no images: no wait, even behind a waiter
        pass
    small_done.set()
    _wait_for(lambda: log == ["small", "huge"])
    assert budget.num_held == 500
    huge_done.set()
    for thread in (small, huge):
        thread.join(5)
    assert budget.num_held == 0
