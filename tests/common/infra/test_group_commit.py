"""common/infra/group_commit.py with a fake transaction: what is asked for while a group is written goes into the
next one, each caller gets its own item's answer, a failed group is committed again item by item (or fails
whole where the writer says so), and close commits what was asked for before it and refuses the rest."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from common.infra.group_commit import GroupCommitter, Pending


class FakeStore:
    """Commits ints; refuses negative ones (a value the database would refuse), and can hold its first group."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []  # what each group transaction was asked to commit
        self.alone: list[int] = []  # what was committed one by one
        self.hold_first = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def commit_group(self, items: list[int]) -> list[str]:
        if self.hold_first.is_set() and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        self.groups.append(list(items))
        if any(item < 0 for item in items):
            raise ValueError("a negative item")
        return [f"done {item}" for item in items]

    def commit_alone(self, item: int) -> str:
        self.alone.append(item)
        if item < 0:
            raise ValueError(f"negative: {item}")
        return f"alone {item}"


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def committer(store: FakeStore) -> Iterator[GroupCommitter[int, str]]:
    c: GroupCommitter[int, str] = GroupCommitter("fake writer", store.commit_group, store.commit_alone)
    yield c
    c.close()


def _hold_first_group(store: FakeStore, committer: GroupCommitter[int, str]) -> Pending[int, str]:
    """Start a group that waits for `store.release`, so that what is asked meanwhile piles up behind it."""
    store.hold_first.set()
    first = committer.submit(0)
    assert store.entered.wait(10)
    return first


def test_items_asked_during_a_write_share_the_next_group(store: FakeStore,
                                                         committer: GroupCommitter[int, str]) -> None:
    first = _hold_first_group(store, committer)
    pending = [committer.submit(i) for i in range(1, 6)]
    assert committer.num_waiting == 5
    store.release.set()
    assert first.result(10) == "done 0"
    assert [p.result(10) for p in pending] == [f"done {i}" for i in range(1, 6)]  # each its own, in order
    assert store.groups == [[0], [1, 2, 3, 4, 5]]
    assert store.alone == []


def test_groups_are_bounded_and_submit_all_shares_one(store: FakeStore) -> None:
    committer: GroupCommitter[int, str] = GroupCommitter("fake writer", store.commit_group, store.commit_alone,
                                                         max_group=4)
    try:
        # Queued before the writer thread starts (it starts with the first ask): groups of at most four.
        assert [p.result(10) for p in committer.submit_all(range(10))] == [f"done {i}" for i in range(10)]
        assert store.groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    finally:
        committer.close()


def test_items_within_the_linger_share_a_group(store: FakeStore) -> None:
    committer: GroupCommitter[int, str] = GroupCommitter("fake writer", store.commit_group, store.commit_alone,
                                                         linger_seconds=0.5)
    try:
        first = committer.submit(1)
        threading.Event().wait(0.05)  # spread out, not piled up behind a slow write
        second = committer.submit(2)
        assert (first.result(10), second.result(10)) == ("done 1", "done 2")
        assert store.groups == [[1, 2]]
    finally:
        committer.close()


def test_one_bad_item_fails_only_its_caller(store: FakeStore, committer: GroupCommitter[int, str]) -> None:
    first = _hold_first_group(store, committer)
    pending = [committer.submit(i) for i in (1, -2, 3)]
    store.release.set()
    first.result(10)
    assert pending[0].result(10) == "alone 1" and pending[2].result(10) == "alone 3"
    with pytest.raises(ValueError, match="negative: -2"):
        pending[1].result(10)
    assert store.groups == [[0], [1, -2, 3]] and store.alone == [1, -2, 3]
    assert committer.submit(4).result(10) == "done 4"  # the writer carries on


def test_a_lone_item_is_retried_alone_by_default(store: FakeStore, committer: GroupCommitter[int, str]) -> None:
    """As a dropped connection fails a group that a new one then writes: even a group of one is tried again."""
    with pytest.raises(ValueError, match="negative: -1"):
        committer.submit(-1).result(10)
    assert store.groups == [[-1]] and store.alone == [-1]


def test_a_writer_can_refuse_the_retry(store: FakeStore) -> None:
    """Where retrying is pointless (the database is unreachable), every item of the group gets the group's error."""
    asked: list[tuple[int, str]] = []

    def retry_alone(num_items: int, error: Exception) -> bool:
        asked.append((num_items, str(error)))
        return False

    committer: GroupCommitter[int, str] = GroupCommitter("fake writer", store.commit_group, store.commit_alone,
                                                         retry_alone=retry_alone)
    try:
        pending = committer.submit_all([1, -2, 3])
        for p in pending:
            with pytest.raises(ValueError, match="a negative item"):
                p.result(10)
        assert asked == [(3, "a negative item")] and store.alone == []
    finally:
        committer.close()


def test_a_broken_commit_answers_every_caller_and_the_writer_carries_on() -> None:
    """A commit that breaks its contract (here one result short) must not leave a caller waiting forever."""
    def short(items: list[int]) -> Sequence[str]:
        return ["x"] * (len(items) - 1) if len(items) > 1 else ["ok"]

    committer: GroupCommitter[int, str] = GroupCommitter("fake writer", short, str)
    try:
        for p in committer.submit_all([1, 2]):
            with pytest.raises(RuntimeError, match="fake writer failed"):
                p.result(10)
        assert committer.submit(3).result(10) == "ok"
    finally:
        committer.close()


def test_a_cancelled_item_is_not_committed(store: FakeStore, committer: GroupCommitter[int, str]) -> None:
    first = _hold_first_group(store, committer)
    gone, kept = committer.submit(1), committer.submit(2)
    assert gone.cancel()  # its caller went away before its group was taken
    store.release.set()
    assert first.result(10) == "done 0" and kept.result(10) == "done 2"
    assert store.groups == [[0], [2]]
    assert not kept.cancel()  # taken: too late to cancel


def test_callbacks_run_on_the_writer_thread(store: FakeStore, committer: GroupCommitter[int, str]) -> None:
    first = _hold_first_group(store, committer)
    pending = committer.submit(1)
    seen: list[str] = []
    pending.add_done_callback(lambda _: seen.append(threading.current_thread().name))  # before its answer
    store.release.set()
    assert first.result(10) == "done 0" and pending.result(10) == "done 1"
    assert seen == ["fake writer"]


def test_close_commits_what_was_asked_and_refuses_the_rest(store: FakeStore,
                                                           committer: GroupCommitter[int, str]) -> None:
    first = _hold_first_group(store, committer)
    pending = [committer.submit(i) for i in range(1, 4)]
    closing = threading.Thread(target=committer.close)
    closing.start()
    while not committer._closed:
        threading.Event().wait(0.01)
    with pytest.raises(RuntimeError, match="fake writer is closed"):
        committer.submit(9)
    with pytest.raises(RuntimeError, match="closed"):
        committer.submit_all([9])
    store.release.set()
    closing.join(10)
    assert not closing.is_alive()
    assert first.result(0) == "done 0" and [p.result(0) for p in pending] == ["done 1", "done 2", "done 3"]
    assert committer._thread is not None and not committer._thread.is_alive()
    committer.close()  # again: nothing to do


def test_a_committer_never_asked_closes_without_a_thread(store: FakeStore) -> None:
    committer: GroupCommitter[int, str] = GroupCommitter("fake writer", store.commit_group, store.commit_alone)
    committer.close()
    assert committer._thread is None
    with pytest.raises(RuntimeError, match="closed"):
        committer.submit(1)
