"""Image jobs' inputs prepared in processes of their own: fetched, decoded, templated, tokenised, preprocessed.

A worker's job threads share one GIL, and an image job's inputs are the most Python it runs per job: the image's
GET through boto3, its decode, and the HF processor (which also runs under one lock, since a fast tokenizer
cannot be used from two threads at once). With tiny models that GIL time paced a worker's intake
(docs/benchmarks.md); with larger images (InternVL's tiles, Qwen2-VL's native resolution)
the processor alone takes tens of milliseconds, and a GPU worker with many cores would be held to one of them.
Here each process has its own object store client and a weightless copy of the model (`load_model(weights=
False)`: config, tokenizer, processor), and returns the engine's `PreparedInput`, pixels included.

Text-only jobs stay in their thread: templating and tokenising a prompt is well under the cost of the round
trip. A process that dies (killed, out of memory) breaks the pool: the jobs it held are released and retried
like those of a crashed engine, and a new pool takes the next jobs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait
from typing import Any

from common.infra.settings import Settings
from common.infra.storage import make_store
from worker.engine.model_runner import PreparedInput, prepare_input, without_decoded_images
from worker.jobs.image_reader import ImageReader, ImageRef
from worker.jobs.request import fetch_images, generation_request
from worker.jobs.retry import infra_retry

log = logging.getLogger(__name__)

START_TIMEOUT_SECONDS = 300.0  # a process imports torch and transformers and loads the processor

# What one pool process holds (set by _start, in that process).
_settings: Settings | None = None
_images: ImageReader | None = None
_front: Any = None
_family: Any = None


def _start(settings: Settings) -> None:
    global _settings, _images, _front, _family
    import torch

    from worker.engine.families import get_family
    from worker.inference.model_loader import load_model

    # The pool's own queue keeps its pipe open in here, so a worker killed outright would leave this process
    # waiting forever: it follows its parent instead.
    threading.Thread(target=_exit_with_parent, name="vlmq-prepare-parent", daemon=True).start()
    # One thread each: the pool's processes are the parallelism, and the engine owns the CPUs' thread pools.
    torch.set_num_threads(1)
    _settings = settings
    _images = ImageReader(make_store(settings))
    _front = load_model(settings.model, dtype=getattr(torch, settings.dtype), weights=False,
                        torch_resize=settings.image_resize == "torch")
    _family = get_family(_front.model)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(0)


def _ready() -> bool:
    return _front is not None


@infra_retry  # as the job thread's own fetch
def _read(ref: ImageRef) -> bytes:
    assert _images is not None
    return _images.read(ref)


def _prepare(job_id: str, request: dict[str, Any], priority: int, tenant: str,
             fetched: Mapping[ImageRef, bytes]) -> PreparedInput:
    assert _settings is not None
    images = fetch_images(request, _settings, _read, fetched)
    req = generation_request(job_id, request, priority, _settings, images, tenant)
    return without_decoded_images(prepare_input(_front, _family, req))


class PreparePool:
    def __init__(self, settings: Settings, num_processes: int) -> None:
        self.settings = settings
        self.num_processes = num_processes
        self.num_replaced = 0  # pools replaced after one of their processes died
        self._lock = threading.Lock()
        self._executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn: the worker has threads (Celery's, the heartbeat, the engine's supervisor) that fork would copy
        # in whatever state they are in.
        executor = ProcessPoolExecutor(self.num_processes, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_start, initargs=(self.settings,))
        # Started here and waited on until they answer, so that the first jobs do not wait for torch's import.
        for ready in [executor.submit(_ready) for _ in range(self.num_processes)]:
            ready.result(START_TIMEOUT_SECONDS)
        return executor

    def prepare(self, job_id: str, request: dict[str, Any], priority: int, tenant: str,
                fetched: Mapping[ImageRef, bytes] | None = None) -> PreparedInput:
        """`fetched`: images already read (ImageReader.read_many), sent along; the rest are read in there.
        Raises what the job thread would (InputError, ImageError, ObjectNotFound, ...), or BrokenProcessPool
        if a process died while the pool held the job."""
        executor = self._executor
        try:
            return executor.submit(_prepare, job_id, request, priority, tenant, fetched or {}).result()
        except BrokenProcessPool:
            self._replace(executor)
            raise

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is not broken:
                return  # another job's thread replaced it already
            log.error("a prepare process died; its jobs are released and a new pool of %d starts",
                      self.num_processes)
            broken.shutdown(wait=False, cancel_futures=True)
            self._executor = self._start()
            self.num_replaced += 1

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
