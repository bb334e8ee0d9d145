"""Everything a worker process builds once: database, object store, model, batcher, heartbeat."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.images.decode import register_image_plugins
from common.infra.db import Database, get_database
from common.infra.settings import Settings, get_settings
from common.infra.storage import ObjectStore, make_store
from common.infra.warm_up import warm_up
from worker.inference.batcher import BatchingGenerator, EngineGenerator, Generator
from worker.jobs.chunk_runner import ChunkRunner
from worker.jobs.group import JobGroupRunner
from worker.jobs.leases import LeaseKeeper
from worker.jobs.pipeline import JobPipeline
from worker.jobs.telemetry import WorkerTelemetry

if TYPE_CHECKING:
    from worker.engine.core.config import EngineConfig
    from worker.inference.model_loader import LoadedModel
    from worker.jobs.prepare_pool import PreparePool

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    settings: Settings
    db: Database
    store: ObjectStore
    generator: Generator
    leases: LeaseKeeper
    pipeline: JobPipeline
    chunks: ChunkRunner  # runs the rows of a message that carries several
    worker_id: str
    telemetry: WorkerTelemetry | None = None  # metrics and the live record of this worker (status page)

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        self.chunks.pool.close()
        self.pipeline.close()
        self.generator.close()
        self.leases.close()


def build_context(settings: Settings) -> WorkerContext:
    import torch

    from worker.inference.model_loader import default_max_tokens, load_model

    if not settings.model:
        raise RuntimeError("no model configured: set VLMQ_MODEL (an HF model id or a local path)")
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    settings = settings.model_copy(update={"default_max_tokens": default_max_tokens(settings.model, settings)})
    db = get_database(settings.database_url)
    store = make_store(settings)
    dtype = getattr(torch, settings.dtype)
    log.info("worker %s loading model %s on %s (%s)", worker_id, settings.model, settings.device, settings.dtype)
    generator = engine_process(settings) if settings.engine_process else None
    if settings.backend == "null":
        from worker.inference.null_generator import NullGenerator

        generator = NullGenerator(load_model(settings.model, dtype=dtype, weights=False,
                                             torch_resize=settings.image_resize == "torch"))
    if generator is None:
        loaded = load_model(settings.model, device=settings.device, dtype=dtype,
                            torch_resize=settings.image_resize == "torch")
        generator = make_backend(loaded, settings)
    leases = LeaseKeeper(db, worker_id, settings.lease_seconds, settings.heartbeat_seconds,
                         on_lost=generator.abort)
    pipeline = JobPipeline(settings, db, store, generator, leases, worker_id, prepare_pool(settings, generator))
    warm_up([db, pipeline.writer.db], store)  # before the first message, not by it
    register_image_plugins()
    telemetry = WorkerTelemetry(settings, generator, leases, worker_id, pipeline.clock,
                                pipeline.prepare_pool).start()
    # A message may arrive while all but one of the worker's slots are taken (worker/jobs/prefetch_share.py): its
    # jobs then briefly exceed worker_concurrency by up to job_ids_per_message - 1.
    pool = JobGroupRunner(pipeline, settings.worker_concurrency + settings.job_ids_per_message)
    chunks = ChunkRunner(pipeline, pool)
    return WorkerContext(settings, db, store, generator, leases, pipeline, chunks, worker_id, telemetry)


def engine_config(settings: Settings) -> EngineConfig:
    from worker.engine.core.config import EngineConfig

    return EngineConfig(
        block_size=settings.kv_block_size, num_kv_blocks=settings.kv_num_blocks,
        kv_cache_fraction=settings.kv_cache_fraction, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_encoder_items_per_step=settings.max_encoder_items_per_step,
        encoder_cache_tokens=settings.encoder_cache_tokens,
        cpu_attention_kernel=settings.cpu_fast_paths, cpu_packed_linear=settings.cpu_fast_paths,
        cpu_fused_elementwise=settings.cpu_fast_paths,
        compile_layers=settings.engine_compile,
        step_linger_seconds=settings.engine_step_linger_ms / 1000,
    )


def engine_process(settings: Settings) -> Generator | None:
    """The paged engine in a child process, where the backend setting allows it and it supports the model's
    family; None where the model is to be loaded here instead (the HF backend)."""
    import torch

    from worker.engine.families import get_family
    from worker.engine.process import EngineProcess, EngineSpec
    from worker.inference.model_loader import load_model

    if settings.backend in ("hf", "null"):
        return None
    front = load_model(settings.model, dtype=getattr(torch, settings.dtype), weights=False,
                       torch_resize=settings.image_resize == "torch")
    if settings.backend == "auto":
        try:
            get_family(front.model)
        except ValueError:
            return None  # make_backend says why, once it has loaded the model
    spec = EngineSpec(model=settings.model, device=settings.device, dtype=settings.dtype,
                      config=engine_config(settings), log_format=settings.log_format,
                      log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                      nice=settings.engine_nice, gc_freeze=settings.gc_freeze)
    return EngineProcess(spec, front=front)


def prepare_pool(settings: Settings, generator: Generator) -> PreparePool | None:
    """The pool of settings.prepare_processes, where the generator takes the paged engine's inputs from anywhere
    (the HF backend batches prepared inputs of its own)."""
    from worker.jobs.prepare_pool import PreparePool

    if settings.prepare_processes == 0:
        return None
    if not isinstance(generator, EngineGenerator):
        log.warning("VLMQ_PREPARE_PROCESSES applies to the paged engine only; image jobs are prepared in their "
                    "own threads")
        return None
    log.info("starting %d prepare processes", settings.prepare_processes)
    return PreparePool(settings, settings.prepare_processes)


def make_backend(loaded: LoadedModel, settings: Settings) -> Generator:
    """The paged engine where it supports the model's family, else batched HF generate."""
    from worker.engine.engine import Engine
    from worker.engine.families import get_family
    from worker.engine.service import EngineService
    from worker.inference.hf_runner import HFBatchRunner

    use_engine = settings.backend == "engine"
    if settings.backend == "auto":
        try:
            get_family(loaded.model)
            use_engine = True
        except ValueError as exc:
            log.warning("falling back to batched HF generate: %s", exc)
    if not use_engine:
        return BatchingGenerator(HFBatchRunner(loaded), max_batch_size=settings.max_batch_size,
                                 batch_wait_s=settings.batch_wait_ms / 1000)
    return EngineService(Engine(loaded, engine_config(settings)))


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def get_context(settings: Settings | None = None) -> WorkerContext:
    """The process's context, built on first use (the model loads once per process, not per task)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = build_context(settings or get_settings())
        return _context


def current_context() -> WorkerContext | None:
    """The process's context if it has been built; never builds it (a batch-only process loads no model)."""
    with _context_lock:
        return _context


def set_context(context: WorkerContext | None) -> None:
    global _context
    with _context_lock:
        _context = context
