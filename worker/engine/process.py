"""The engine in a process of its own, as vLLM v1 runs its engine core.

In one process the engine's Python (scheduling, model code between kernels, sampling) shares one GIL with
everything a worker does per job: Celery's delivery, the claim and finish in SQL, the result's PUT, prompt
encoding. Each of those holds the GIL in slices the engine thread then waits out, so both sides run slower than
their CPU allows. Here the engine steps in a child process, and the worker's threads only prepare requests
(template, tokenise, preprocess, on a weightless copy of the model) and wait on futures.

One socket pair carries everything: prepared inputs and aborts go down; results, errors and a metrics snapshot
(once a second, and whenever the engine runs out of work) come up. Messages are plain pickles: tensors are
copied, not put in shared memory, since a request's pixels cross once and no file descriptor is passed per
tensor.

If the child dies (a crash in a kernel, the OOM killer), the requests it held fail like those of a dead worker
(their jobs are released and retried), and a new child is started, with back-off; submissions wait for it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Literal

from worker.engine import vision_batches
from worker.engine.channel import Channel
from worker.engine.core.config import EngineConfig
from worker.engine.model_runner import PreparedInput, prepare_input, without_decoded_images
from worker.inference.generation import GenerationRequest, GenerationResult
from worker.inference.model_loader import LoadedModel

log = logging.getLogger(__name__)

MAX_RESTART_DELAY_SECONDS = 60.0


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine (all picklable, no model objects)."""

    model: str
    device: str
    dtype: str
    config: EngineConfig
    log_format: str = "text"
    log_level: str = "INFO"
    nice: int = 0  # added to the child's niceness (settings.engine_nice)
    # freeze the child's heap once the engine is built (settings.gc_freeze, common/infra/heap.py)
    gc_freeze: bool = False


class EngineDied(RuntimeError):
    """The engine process exited while it held the request."""


class EngineProcess:
    """An `EngineGenerator` (worker/inference/batcher.py) whose engine runs in a child process (see the module
    docstring)."""

    takes_engine_inputs: Literal[True] = True

    def __init__(self, spec: EngineSpec, front: LoadedModel | None = None, start_timeout: float | None = None) -> None:
        """`front`: the model as `load_model(weights=False)` gives it, if the caller has it already."""
        import torch

        from worker.engine.families import get_family
        from worker.inference.model_loader import load_model

        self.spec = spec
        self._front = front or load_model(spec.model, dtype=getattr(torch, spec.dtype), weights=False)
        self._family = get_family(self._front.model)
        self._prepare_lock = threading.Lock()  # HF fast tokenizers are not safe to share between threads
        self._futures: dict[str, Future[GenerationResult]] = {}
        self._futures_lock = threading.Lock()
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._metrics: dict[str, float] = {}
        self.vision_batch_sizes: list[int] = []
        self.num_restarts = 0
        self._start_timeout = start_timeout
        self._started_at = 0.0
        self.ready_info: dict[str, object] = {}  # what the child said when it was ready (the latest child's)
        self._process, self._channel = self._spawn()
        self._ready.set()
        self._supervisor = threading.Thread(target=self._supervise, name="vlmq-engine-supervisor", daemon=True)
        self._supervisor.start()
        atexit.register(self.close)  # lets the child finish what it holds; without it, it exits on the pipe's EOF

    # ------------------------------------------------------------------ the Generator contract

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        with self._prepare_lock:
            prepared = prepare_input(self._front, self._family, req)
        return without_decoded_images(prepared)

    def submit(self, prepared: PreparedInput) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        request_id = prepared.request.request_id
        while not self._ready.wait(1.0):
            if self._closing.is_set():
                break
        if self._closing.is_set():
            raise RuntimeError("engine service is closed")
        with self._futures_lock:
            self._futures[request_id] = future
        try:
            self._channel.send(("add", prepared))
        except (OSError, ValueError) as exc:  # the child died between the check and the send
            with self._futures_lock:
                self._futures.pop(request_id, None)
            future.set_exception(EngineDied(f"engine process is gone: {exc}"))
        return future

    def abort(self, request_id: str) -> None:
        # A dead child holds nothing to abort; its futures fail on their own.
        with contextlib.suppress(OSError, ValueError):
            self._channel.send(("abort", request_id))

    def close(self, timeout: float = 10.0) -> None:
        atexit.unregister(self.close)
        self._closing.set()
        with contextlib.suppress(OSError, ValueError):
            self._channel.send(("close",))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._supervisor.join(timeout)
        self._fail_all(RuntimeError("engine service closed"))

    # ------------------------------------------------------------------ what telemetry reads

    def metrics(self) -> dict[str, float]:
        """The child's engine counters as of its last snapshot (at most a second old)."""
        return dict(self._metrics)

    @property
    def pid(self) -> int:
        return self._process.pid

    # ------------------------------------------------------------------ the child's lifecycle

    def _spawn(self) -> tuple[subprocess.Popen[bytes], Channel]:
        # A fresh interpreter, not a fork: the parent has threads (Celery's, the heartbeat) and an initialised
        # OpenMP or CUDA. Not multiprocessing's spawn either: that re-imports the caller's __main__, and its exit
        # hook SIGTERMs (ignored here) and joins the children it knows, which would hang a worker's exit.
        parent_end, child_end = socket.socketpair()
        # The parent's code, whichever checkout it was imported from.
        path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "worker.engine.child", str(child_end.fileno())],
                                   pass_fds=[child_end.fileno()], env={**os.environ, "PYTHONPATH": path})
        child_end.close()
        channel = Channel(Connection(parent_end.detach()))
        channel.send(("spec", self.spec))
        try:
            info = self._await_ready(process, channel)
        except BaseException:
            process.kill()  # already gone, unless it was too slow
            process.wait(5)
            channel.close()
            raise
        log.info("engine process %s ready: %s", process.pid, info)
        self.ready_info = dict(info)
        self._started_at = time.monotonic()
        return process, channel

    def _await_ready(self, process: subprocess.Popen[bytes], channel: Channel) -> dict[str, object]:
        deadline = None if self._start_timeout is None else time.monotonic() + self._start_timeout
        while not channel.conn.poll(1.0):
            if process.poll() is not None or (deadline is not None and time.monotonic() > deadline):
                raise RuntimeError(f"engine process did not start (exit code {process.poll()})")
        try:
            message = channel.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"engine process exited while starting (exit code {process.wait(5)})") from None
        if message[0] != "ready":
            raise RuntimeError(f"engine process failed to start: {message[1]}")
        return message[1]

    def _supervise(self) -> None:
        delay = 1.0
        while True:
            self._read(self._channel)
            if self._closing.is_set():
                return
            self._ready.clear()
            self._channel.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(5)
            if time.monotonic() - self._started_at > MAX_RESTART_DELAY_SECONDS:
                delay = 1.0  # it had run a while: a new crash, not the same start failing again
            log.error("engine process %s exited (code %s); failing its requests and starting a new one",
                      self._process.pid, self._process.returncode)
            self._fail_all(EngineDied(f"engine process exited with code {self._process.returncode}"))
            while not self._closing.is_set():
                time.sleep(delay)
                try:
                    self._process, self._channel = self._spawn()
                except Exception:
                    log.exception("engine process restart failed; retrying in %.0f s", delay)
                    delay = min(2 * delay, MAX_RESTART_DELAY_SECONDS)
                    continue
                self.num_restarts += 1
                self._ready.set()
                break

    def _read(self, channel: Channel) -> None:
        """Until the child's end closes: resolve futures, keep the latest metrics."""
        while True:
            try:
                message = channel.recv()
            except (EOFError, OSError):
                return
            except Exception:  # one unreadable message must not stop the reader: every future would hang
                log.exception("engine process sent a message that does not unpickle; dropped")
                continue
            kind = message[0]
            if kind == "done":
                _, request_id, result, error = message
                with self._futures_lock:
                    future = self._futures.pop(request_id, None)
                if future is None or future.done():
                    continue
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
            elif kind == "metrics":
                self._metrics = message[1]
                vision_batches.record(self.vision_batch_sizes, message[2])

    def _fail_all(self, error: Exception) -> None:
        with self._futures_lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)
