"""Group commit: items asked for by many threads while one transaction is being written go into the next one,
and each caller gets its own item's result, or its own error, through a future.

The writers built on it (api/job_writer.py, worker/jobs/state_writer.py) give it two functions: one that
commits a group of items in one transaction and returns their results in the same order, and one that commits
a single item alone. One thread takes whatever is waiting (up to `max_group`, after an optional linger for
more), commits it as one group and answers every item. If the group's transaction fails, its items are
committed one by one, so that one bad item (a value the database refuses) fails only its own caller; a writer
can refuse that retry for errors where it is pointless (the database is unreachable). Batching needs no timer:
under load, items pile up while a group is written, so groups grow with the load and a lone item is written
at once.

Answers are set on the writer's thread, in the order the items were asked for; callbacks added to a future
run there, so they must not block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")
T = TypeVar("T")


class Pending(Future[Result], Generic[Item, Result]):
    """One asked-for item and the future of its result, as one object: a caller's ask on a hot path costs a
    single allocation beside its item."""

    def __init__(self, item: Item) -> None:
        super().__init__()
        self.item = item


def _retry_any(num_items: int, error: Exception) -> bool:
    return True


class GroupCommitter(Generic[Item, Result]):
    """`commit_group(items)` commits items in one transaction and returns their results, one per item in the
    same order; `commit_alone(item)` commits one item on its own. `retry_alone(num_items, error)` says whether
    a group that failed with `error` is committed again item by item (the default: always, a lone item
    included, as a dropped connection fails a group that a new one then writes); where it says no, every item
    of the group gets the error. `commit_group` must not raise once its transaction has committed: its items
    would be committed again. With `cancellable`, an item whose future was cancelled before its group was
    taken is not committed; without, callers must not cancel (an ask costs no state change then). The writer
    thread starts with the first item asked for."""

    def __init__(self, name: str, commit_group: Callable[[list[Item]], Sequence[Result]],
                 commit_alone: Callable[[Item], Result], *,
                 retry_alone: Callable[[int, Exception], bool] = _retry_any, max_group: int = 512,
                 linger_seconds: float = 0.0, cancellable: bool = True, thread_name: str | None = None) -> None:
        self.name = name
        self.commit_group = commit_group
        self.commit_alone = commit_alone
        self.retry_alone = retry_alone
        self.max_group = max_group
        self.linger_seconds = linger_seconds
        self.cancellable = cancellable
        self._thread_name = thread_name or name
        self._queue: queue.SimpleQueue[Pending[Item, Result] | None] = queue.SimpleQueue()
        # Items are queued under this lock, before `close` queues the stop: none can land after it and wait
        # forever for an answer.
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def num_waiting(self) -> int:
        """Items asked for that no group has taken yet."""
        return self._queue.qsize()

    def submit(self, item: Item) -> Pending[Item, Result]:
        """Ask for `item` to be committed; the future answers its result. Raises RuntimeError once the
        committer is closed."""
        pending: Pending[Item, Result] = Pending(item)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.put(pending)
            if self._thread is None:
                self._start()
        return pending

    def submit_all(self, items: Iterable[Item]) -> list[Pending[Item, Result]]:
        """`submit` of each item, queued together so that they share a group (up to `max_group`)."""
        pendings: list[Pending[Item, Result]] = [Pending(item) for item in items]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            for pending in pendings:
                self._queue.put(pending)
            if self._thread is None:  # after the puts: what was asked for before it started is one group
                self._start()
        return pendings

    def close(self, timeout: float = 10.0) -> None:
        """Commit what was asked for before, then stop the writer thread (waiting up to `timeout` for it).
        Items asked for afterwards are refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (group := next_group(self._queue, self.max_group, self.linger_seconds)) is not None:
            if self.cancellable:
                # An item whose caller gave up before its turn (an API client that went away) is not
                # committed; the others can no longer be cancelled, so their answers can always be set.
                group = [pending for pending in group if pending.set_running_or_notify_cancel()]
                if not group:
                    continue
            try:
                self._commit(group)
            except Exception:  # never let one group stop the writer: every later item would wait forever
                log.exception("%s: a group of %d failed", self.name, len(group))
                _fail_unanswered(group, RuntimeError(f"{self.name} failed"))
            except BaseException as exc:
                _fail_unanswered(group, exc)
                raise

    def _commit(self, group: list[Pending[Item, Result]]) -> None:
        try:
            results = self.commit_group([pending.item for pending in group])
        except Exception as exc:
            if not self.retry_alone(len(group), exc):
                for pending in group:
                    pending.set_exception(exc)
                return
            if len(group) > 1:
                log.warning("%s: a group of %d failed; committing them one by one", self.name, len(group),
                            exc_info=True)
            for pending in group:
                _answer(pending, self.commit_alone)
            return
        if len(results) != len(group):  # a broken commit function: answer no one a result that may be another's
            raise RuntimeError(f"{self.name}: {len(results)} results for a group of {len(group)}")
        for pending, result in zip(group, results, strict=True):
            pending.set_result(result)


def _answer(pending: Pending[Item, Result], commit_alone: Callable[[Item], Result]) -> None:
    """Commit `pending`'s item alone and hand its result, or its error, to its caller."""
    try:
        result = commit_alone(pending.item)
    except Exception as exc:
        pending.set_exception(exc)
        return
    pending.set_result(result)


def _fail_unanswered(group: Sequence[Future[Any]], error: BaseException) -> None:
    for pending in group:
        if not pending.done():
            pending.set_exception(error)


def next_group(items: queue.SimpleQueue[T | None], max_items: int, linger_seconds: float = 0.0) -> list[T] | None:
    """The next group: block for the first item, then take whatever else has arrived meanwhile, up to
    `max_items`; None once the stop (None) is next. A stop met while draining ends this group and is put
    back, so the following call returns None. With `linger_seconds`, the group waits that long after its first
    item for more to arrive (a writer whose items arrive spread out, such as a worker's finishes as the engine
    ends them, gets company that way)."""
    first = items.get()
    if first is None:
        return None
    group = [first]
    deadline = time.monotonic() + linger_seconds
    while len(group) < max_items:
        try:
            item = items.get_nowait()
        except queue.Empty:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = items.get(timeout=remaining)
            except queue.Empty:
                break
        if item is None:
            items.put(None)
            break
        group.append(item)
    return group
