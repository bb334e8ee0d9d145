"""common/coalesce.py: requests made while a run is in progress earn exactly one more run, never none."""

from __future__ import annotations

import threading

import pytest

from common.coalesce import Coalescer


def test_requests_during_a_run_share_one_more_run() -> None:
    coalescer = Coalescer()
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def slow() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            started.set()
            release.wait(10)

    first = threading.Thread(target=coalescer.run, args=("k", slow))
    first.start()
    assert started.wait(10)
    # Five more requests while the first run is in progress: none runs itself, all are covered by one rerun.
    assert [coalescer.run("k", slow) for _ in range(5)] == [False] * 5
    release.set()
    first.join(10)
    assert runs == [0, 1]
    assert coalescer.run("k", slow) is True  # the key is free again: a later request runs at once
    assert runs == [0, 1, 2]


def test_keys_do_not_wait_for_each_other() -> None:
    coalescer = Coalescer()
    inner: list[bool] = []
    coalescer.run("a", lambda: inner.append(coalescer.run("b", lambda: None)))
    assert inner == [True]


def test_an_error_reaches_the_runner_and_frees_the_key() -> None:
    coalescer = Coalescer()

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        coalescer.run("k", boom)
    assert coalescer.run("k", lambda: None) is True
