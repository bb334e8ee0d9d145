"""A thread in front of the engine: task threads submit prepared requests and wait on futures.

The engine is stepped by one thread only; submissions and aborts reach it through a queue, so no lock is held
while the model runs.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from worker.engine.engine import Engine
from worker.engine.model_runner import PreparedInput
from worker.generation import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


class EngineService:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._futures: dict[str, Future[GenerationResult]] = {}
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

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._inbox.put(("close", None))
        self._thread.join(timeout)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False once closed."""
        try:
            command, payload = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command == "close":
                return False
            if command == "add":
                prepared, future = payload  # type: ignore[misc]
                request_id = prepared.request.request_id
                if future.set_running_or_notify_cancel():
                    try:
                        self.engine.add_request(prepared)
                    except Exception as exc:  # InputError: this request can never run here
                        future.set_exception(exc)
                    else:
                        self._futures[request_id] = future
            elif command == "abort":
                request_id = str(payload)
                self.engine.abort(request_id)
                future = self._futures.pop(request_id, None)
                if future is not None:
                    future.set_exception(RuntimeError(f"request {request_id} was aborted"))
            try:
                command, payload = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _loop(self) -> None:
        while True:
            if not self._drain(block=not self.engine.has_unfinished()):
                break
            if not self.engine.has_unfinished():
                continue
            try:
                results = self.engine.step()
            except Exception as exc:
                # A broken step leaves the engine's state unknown: fail what is in flight, start clean.
                log.exception("engine step failed; failing %d in-flight requests", len(self._futures))
                for request_id, future in self._futures.items():
                    self.engine.abort(request_id)
                    future.set_exception(exc)
                self._futures.clear()
                continue
            for result in results:
                future = self._futures.pop(result.request_id, None)
                if future is not None:
                    future.set_result(result)
        for future in self._futures.values():
            future.set_exception(RuntimeError("engine service closed"))
