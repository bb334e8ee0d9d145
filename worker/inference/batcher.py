"""Greedy cross-job batching in front of a model backend.

Many Celery task threads submit prepared requests; one generation thread takes whatever has arrived (waiting
`batch_wait_s` for more once the first is there, up to `max_batch_size`) and runs it as one batch: one vision
forward for all images, one generation for all prompts. torch runs in this one thread only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from worker.inference.generation import GenerationRequest, GenerationResult, InputError

if TYPE_CHECKING:
    from worker.engine.model_runner import PreparedInput

log = logging.getLogger(__name__)


class Backend(Protocol):
    def prepare(self, req: GenerationRequest) -> Any: ...
    def generate(self, batch: list[Any]) -> list[GenerationResult]: ...


class Generator(Protocol):
    """What the pipeline needs of a model backend: prepare in the caller's thread, then submit and wait."""

    def prepare(self, req: GenerationRequest) -> Any: ...
    def submit(self, prepared: Any) -> Future[GenerationResult]: ...
    # Drop the request, queued or generating: its future fails with `Aborted`; an id it does not hold is ignored.
    # A backend that cannot drop one lets it run on (its result is refused in SQL).
    def abort(self, request_id: str) -> None: ...
    def close(self, timeout: float = 10.0) -> None: ...


@runtime_checkable
class EngineGenerator(Generator, Protocol):
    """A generator in front of the paged engine: its submit() takes a `PreparedInput` made anywhere, not only by
    its own prepare(), so image jobs' inputs may be prepared in processes of their own (worker/jobs/prepare_pool.py).

    `takes_engine_inputs` is what tells one apart at run time: every generator has the same methods, and only
    their argument types, which isinstance cannot see, differ."""

    takes_engine_inputs: Literal[True]

    def prepare(self, req: GenerationRequest) -> PreparedInput: ...
    def submit(self, prepared: PreparedInput) -> Future[GenerationResult]: ...


@dataclass
class BatchStats:
    num_batches: int = 0
    num_requests: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes, default=0)


class BatchingGenerator:
    def __init__(self, backend: Backend, *, max_batch_size: int = 32, batch_wait_s: float = 0.02) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.stats = BatchStats()
        self._pending: queue.Queue[tuple[Any, Future[GenerationResult]] | None] = queue.Queue()
        self._closed = threading.Event()
        self._prepare_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="vlmq-generate", daemon=True)
        self._thread.start()

    def prepare(self, req: GenerationRequest) -> Any:
        """Tokenise and preprocess images in the caller's thread, off the generation thread.

        Serialised: HF fast tokenizers raise "Already borrowed" when one is used from two threads at once."""
        with self._prepare_lock:
            return self.backend.prepare(req)

    def submit(self, prepared: Any) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise RuntimeError("generator is closed")
        future: Future[GenerationResult] = Future()
        self._pending.put((prepared, future))
        return future

    def abort(self, request_id: str) -> None:
        """A padded batch cannot drop one row; the request runs on and its result is refused by SQL."""

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._pending.put(None)
        self._thread.join(timeout)

    def _take_batch(self) -> list[tuple[Any, Future[GenerationResult]]]:
        first = self._pending.get()
        if first is None:
            return []
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = self._pending.get(timeout=max(remaining, 0)) if remaining > 0 else self._pending.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._pending.put(None)  # keep the close signal for the loop
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while not self._closed.is_set():
            batch = self._take_batch()
            if not batch:
                continue
            live = [(p, f) for p, f in batch if f.set_running_or_notify_cancel()]
            if live:
                self._run(live)

    def _run(self, batch: list[tuple[Any, Future[GenerationResult]]]) -> None:
        self.stats.num_batches += 1
        self.stats.num_requests += len(batch)
        self.stats.batch_sizes.append(len(batch))
        try:
            results = self.backend.generate([p for p, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                batch[0][1].set_exception(_as_refusal(exc))
                return
            # One bad request must not fail its batch-mates: isolate it by running each alone.
            log.warning("batch of %d failed (%s); retrying one by one", len(batch), exc)
            for item in batch:
                self._run([item])
            return
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)


def _as_refusal(exc: Exception) -> Exception:
    """What one request alone failed with. A ValueError there is the model's code refusing this input (image
    features that do not match its placeholders, more images than it takes, ...): it would fail the same way
    on every attempt, each later one alone in its worker, so it fails the job now. Anything else (a RuntimeError
    such as running out of memory, an OSError) may pass, and is retried."""
    if isinstance(exc, ValueError) and not isinstance(exc, InputError):
        refusal = InputError(f"the model cannot run this request: {type(exc).__name__}: {exc}")
        refusal.__cause__ = exc
        return refusal
    return exc
