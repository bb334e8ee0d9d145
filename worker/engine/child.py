"""The engine process's main (`python -m worker.engine.child FD`): build the engine its parent describes, then
serve the socket pair (worker/engine/process.py) until told to close or the parent goes away."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection

from worker.engine import vision_batches
from worker.engine.channel import Channel
from worker.engine.model_runner import PreparedInput
from worker.engine.process import EngineSpec
from worker.inference.generation import GenerationResult

log = logging.getLogger(__name__)

METRICS_INTERVAL_SECONDS = 1.0


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

    from common.infra.logs import configure_logging
    from worker.engine.engine import Engine
    from worker.engine.service import EngineService
    from worker.inference.model_loader import load_model

    # A terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process group. The worker's warm
    # shutdown still needs the engine to finish the jobs it holds, so the child leaves signals to its parent,
    # which closes it over the pipe (or dies, and the pipe's end tells the child so).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = Channel(conn)
    spec: EngineSpec = channel.recv()[1]
    configure_logging(spec.log_format, spec.log_level)
    if spec.nice:
        # Below the threads that feed it: on shared CPUs the engine is better off waiting for its next inputs
        # than taking the CPU they are prepared with (bench/compare.py, side by side, image and text jobs).
        # Linux keeps a niceness per thread: the threads torch started on import are moved too, and those
        # started later inherit it from these.
        niceness = min(os.nice(0) + spec.nice, 19)
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
    try:
        loaded = load_model(spec.model, device=spec.device, dtype=getattr(torch, spec.dtype))
        service = EngineService(Engine(loaded, spec.config))
    except Exception as exc:
        log.exception("engine process could not build the engine")
        channel.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    frozen = 0
    if spec.gc_freeze:
        from common.infra.heap import freeze_startup_heap

        frozen = freeze_startup_heap()
    channel.send(("ready", {"pid": os.getpid(), "num_kv_blocks": service.engine.block_manager.num_free_blocks,
                            "gc_frozen_objects": frozen}))
    stop = threading.Event()
    report_lock = threading.Lock()

    def report_metrics() -> None:
        with report_lock:
            new = vision_batches.take(service.engine.runner.vision_batch_sizes)
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
                service.submit(prepared).add_done_callback(partial(reply, request_id))
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
