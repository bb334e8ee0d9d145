"""A thread in front of the engine: task threads submit prepared requests and wait on futures.

The engine is stepped by one thread only; submissions and aborts reach it through a queue, so no lock is held
while the model runs.

Poison isolation: a step that raises fails no request outright, since it cannot say which of the batched
requests broke it. Every request then in flight is re-run alone, one after another, with new submissions held
back meanwhile; the one that fails alone gets the exception, the others finish normally. One poison job costs
its batch-mates a serial re-run, not their attempts.

Linger: while jobs trickle in (each worker thread submits as soon as its job is claimed and prepared), an
engine that steps on whatever has arrived runs many small steps, each costing its fixed per-step work. So
while a request arrived within `step_linger_seconds` and the batch has room, the loop waits up to that long
for the next before stepping: fewer, fuller steps where the per-step work dominates (a tiny model), and no
change where the model's compute does (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Literal, cast

from worker.engine.engine import Engine
from worker.engine.model_runner import PreparedInput
from worker.inference.generation import Aborted, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


class EngineService:
    """An `EngineGenerator` (worker/inference/batcher.py) whose engine runs in this process."""

    takes_engine_inputs: Literal[True] = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._futures: dict[str, Future[GenerationResult]] = {}
        self._prepared: dict[str, PreparedInput] = {}
        # Suspects of a failed step, each to run alone; submissions that arrive meanwhile wait in _held.
        self._suspects: deque[tuple[PreparedInput, Future[GenerationResult]]] = deque()
        self._held: deque[tuple[PreparedInput, Future[GenerationResult]]] = deque()
        self._isolating: str | None = None  # the request now running alone
        self._last_arrival = float("-inf")  # monotonic time of the latest submission
        self._prepare_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vlmq-engine", daemon=True)
        self._thread.start()

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        # Serialised: HF fast tokenizers raise "Already borrowed" when one is used from two threads at once.
        with self._prepare_lock:
            return self.engine.prepare(req)

    def submit(self, prepared: PreparedInput) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise RuntimeError("engine service is closed")
        future: Future[GenerationResult] = Future()
        self._inbox.put(("add", (prepared, future)))
        return future

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    @property
    def vision_batch_sizes(self) -> list[int]:
        return self.engine.runner.vision_batch_sizes

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._inbox.put(("close", None))
        self._thread.join(timeout)

    def _drain(self, block: bool, timeout: float = 0.5) -> bool:
        """Apply queued commands (waiting up to `timeout` for the first if `block`); returns False once closed."""
        try:
            command, payload = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command == "close":
                return False
            if command == "add":
                self._last_arrival = time.monotonic()
                prepared, future = cast(tuple[PreparedInput, Future[GenerationResult]], payload)
                if future.set_running_or_notify_cancel():
                    if self._isolating is not None or self._suspects:
                        self._held.append((prepared, future))
                    else:
                        self._add(prepared, future)
            elif command == "abort":
                self._abort(str(payload))
            try:
                command, payload = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, prepared: PreparedInput, future: Future[GenerationResult]) -> bool:
        request_id = prepared.request.request_id
        try:
            self.engine.add_request(prepared)
        except Exception as exc:  # InputError: this request can never run here
            future.set_exception(exc)
            return False
        self._futures[request_id] = future
        self._prepared[request_id] = prepared
        return True

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._prepared.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is None:  # maybe a suspect or a held submission, not yet in the engine
            for waiting in (self._suspects, self._held):
                for item in list(waiting):
                    if item[0].request.request_id == request_id:
                        waiting.remove(item)
                        future = item[1]
        if future is not None and not future.done():
            future.set_exception(Aborted(f"request {request_id} was aborted"))

    def _on_step_error(self, exc: Exception) -> None:
        if self._isolating is not None:
            # Alone, it failed: this is the poison request.
            log.error("request %s fails even alone; failing it", self._isolating)
            future = self._futures.pop(self._isolating, None)
            self.engine.abort(self._isolating)
            self._prepared.pop(self._isolating, None)
            self._isolating = None
            if future is not None:
                future.set_exception(exc)
            return
        log.exception("engine step failed; re-running its %d requests one at a time", len(self._futures))
        for request_id, future in self._futures.items():
            self.engine.abort(request_id)
            self._suspects.append((self._prepared.pop(request_id), future))
        self._futures.clear()

    def _next_alone(self) -> None:
        """Between isolated runs: start the next suspect, or let held submissions in once all are cleared."""
        while self._suspects and not self.engine.has_unfinished():
            prepared, future = self._suspects.popleft()
            if self._add(prepared, future):
                self._isolating = prepared.request.request_id
                return
        if not self._suspects and not self.engine.has_unfinished():
            self._isolating = None
            while self._held:
                self._add(*self._held.popleft())

    def _should_linger(self) -> bool:
        linger = self.engine.config.step_linger_seconds
        return (linger > 0 and self._isolating is None and len(self._futures) < self.engine.config.max_num_seqs
                and time.monotonic() - self._last_arrival < linger)

    def _loop(self) -> None:
        while True:
            if not self._drain(block=not (self.engine.has_unfinished() or self._suspects or self._held)):
                break
            if self._isolating is not None and self._isolating not in self._futures:
                self._isolating = None  # it finished (or was aborted)
            if self._isolating is None and (self._suspects or self._held):
                self._next_alone()
            if not self.engine.has_unfinished():
                continue
            if self._should_linger() and not self._drain(block=True, timeout=self.engine.config.step_linger_seconds):
                break
            try:
                results = self.engine.step()
            except Exception as exc:
                self._on_step_error(exc)
                continue
            for result in results:
                self._prepared.pop(result.request_id, None)
                future = self._futures.pop(result.request_id, None)
                if future is not None:
                    future.set_result(result)
        for future in [*self._futures.values(), *(f for _, f in self._suspects), *(f for _, f in self._held)]:
            if not future.done():
                future.set_exception(RuntimeError("engine service closed"))
