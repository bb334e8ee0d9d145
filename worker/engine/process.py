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
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from worker.engine.config import EngineConfig
from worker.engine.model_runner import PreparedInput, prepare_input
from worker.generation import GenerationRequest, GenerationResult
from worker.model_loader import LoadedModel

log = logging.getLogger(__name__)

METRICS_INTERVAL_SECONDS = 1.0
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


class EngineDied(RuntimeError):
    """The engine process exited while it held the request."""


class _Channel:
    """One end of the pipe: whole pickled messages, sends serialised across threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple[Any, ...]:
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        with self._send_lock:
            self.conn.close()


class EngineProcess:
    """A `Generator` whose engine runs in a child process (see the module docstring)."""

    def __init__(self, spec: EngineSpec, front: LoadedModel | None = None, start_timeout: float | None = None) -> None:
        """`front`: the model as `load_model(weights=False)` gives it, if the caller has it already."""
        import torch

        from worker.engine.families import get_family
        from worker.model_loader import load_model

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
        self._process, self._channel = self._spawn()
        self._ready.set()
        self._supervisor = threading.Thread(target=self._supervise, name="vlmq-engine-supervisor", daemon=True)
        self._supervisor.start()
        atexit.register(self.close)  # lets the child finish what it holds; without it, it exits on the pipe's EOF

    # ------------------------------------------------------------------ the Generator contract

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        with self._prepare_lock:
            prepared = prepare_input(self._front, self._family, req)
        # The pixels are in image_inputs; the PIL images need not cross the pipe.
        return replace(prepared, request=replace(prepared.request, images=[]))

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

    def _spawn(self) -> tuple[subprocess.Popen[bytes], _Channel]:
        # A fresh interpreter, not a fork: the parent has threads (Celery's, the heartbeat) and an initialised
        # OpenMP or CUDA. Not multiprocessing's spawn either: that re-imports the caller's __main__, and its exit
        # hook SIGTERMs (ignored here) and joins the children it knows, which would hang a worker's exit.
        parent_end, child_end = socket.socketpair()
        # The parent's code, whichever checkout it was imported from.
        path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "worker.engine.process", str(child_end.fileno())],
                                   pass_fds=[child_end.fileno()], env={**os.environ, "PYTHONPATH": path})
        child_end.close()
        channel = _Channel(Connection(parent_end.detach()))
        channel.send(("spec", self.spec))
        deadline = None if self._start_timeout is None else time.monotonic() + self._start_timeout
        while not channel.conn.poll(1.0):
            if process.poll() is not None or (deadline is not None and time.monotonic() > deadline):
                process.kill()
                process.wait(5)
                channel.close()
                raise RuntimeError(f"engine process did not start (exit code {process.returncode})")
        try:
            message = channel.recv()
        except (EOFError, OSError):
            process.wait(5)
            channel.close()
            raise RuntimeError(f"engine process exited while starting (exit code {process.returncode})") from None
        if message[0] != "ready":
            process.wait(5)
            channel.close()
            raise RuntimeError(f"engine process failed to start: {message[1]}")
        log.info("engine process %s ready: %s", process.pid, message[1])
        return process, channel

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

    def _read(self, channel: _Channel) -> None:
        """Until the child's end closes: resolve futures, keep the latest metrics."""
        while True:
            try:
                message = channel.recv()
            except (EOFError, OSError):
                return
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
                self.vision_batch_sizes.extend(message[2])

    def _fail_all(self, error: Exception) -> None:
        with self._futures_lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(error)


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (InputError does), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def run_engine_child(conn: Connection) -> None:
    """The child's main: build the engine the first message describes, then serve the pipe until told to close
    or the parent goes away."""
    import torch

    from common.logs import configure_logging
    from worker.engine.engine import Engine
    from worker.engine.service import EngineService
    from worker.model_loader import load_model

    # A terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process group. The worker's warm
    # shutdown still needs the engine to finish the jobs it holds, so the child leaves signals to its parent,
    # which closes it over the pipe (or dies, and the pipe's end tells the child so).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = _Channel(conn)
    spec: EngineSpec = channel.recv()[1]
    configure_logging(spec.log_format, spec.log_level)
    try:
        loaded = load_model(spec.model, device=spec.device, dtype=getattr(torch, spec.dtype))
        service = EngineService(Engine(loaded, spec.config))
    except Exception as exc:
        log.exception("engine process could not build the engine")
        channel.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    channel.send(("ready", {"pid": os.getpid(),
                            "num_kv_blocks": service.engine.block_manager.num_free_blocks}))
    stop = threading.Event()
    report_lock = threading.Lock()
    vision_seen = 0

    def report_metrics() -> None:
        nonlocal vision_seen
        with report_lock:
            sizes = service.engine.runner.vision_batch_sizes
            new, vision_seen = sizes[vision_seen:], len(sizes)
            with contextlib.suppress(OSError, ValueError):  # the parent is gone; the read loop ends too
                channel.send(("metrics", service.engine.metrics(), new))

    def report_every_interval() -> None:
        while not stop.wait(METRICS_INTERVAL_SECONDS):
            report_metrics()

    def reply(request_id: str, future: Future[GenerationResult]) -> None:
        error = future.exception()
        with contextlib.suppress(OSError, ValueError):
            channel.send(("done", request_id, None if error else future.result(),
                          None if error is None else _portable(error)))
        # Run in the engine thread: once it has nothing left, the parent's counters are brought up to date at
        # once, so what a finished batch reports matches its jobs without waiting for the next second.
        if not service.engine.has_unfinished():
            report_metrics()

    metrics_thread = threading.Thread(target=report_every_interval, name="vlmq-engine-metrics", daemon=True)
    metrics_thread.start()
    try:
        while True:
            try:
                message = channel.recv()
            except (EOFError, OSError):
                break  # the parent exited: nobody is left to take results
            if message[0] == "add":
                prepared: PreparedInput = message[1]
                request_id = prepared.request.request_id
                service.submit(prepared).add_done_callback(lambda f, rid=request_id: reply(rid, f))
            elif message[0] == "abort":
                service.abort(message[1])
            elif message[0] == "close":
                break
    finally:
        stop.set()
        service.close()
        metrics_thread.join(5)


if __name__ == "__main__":
    run_engine_child(Connection(int(sys.argv[1])))
    # Nothing is left to finalise, and skipping the interpreter's teardown spares a C++ runtime torn down
    # under threads that are still parked in it ("terminate called without an active exception", seen here).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
