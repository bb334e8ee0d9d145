"""Everything a worker process builds once: database, object store, model, batcher, heartbeat."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass

from common.db import Database, get_database
from common.settings import Settings, get_settings
from common.storage import ObjectStore, make_store
from worker.batcher import BatchingGenerator
from worker.leases import LeaseKeeper
from worker.pipeline import JobPipeline

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    settings: Settings
    db: Database
    store: ObjectStore
    generator: BatchingGenerator
    leases: LeaseKeeper
    pipeline: JobPipeline
    worker_id: str

    def close(self) -> None:
        self.generator.close()
        self.leases.close()


def build_context(settings: Settings) -> WorkerContext:
    import torch

    from worker.hf_runner import HFBatchRunner
    from worker.model_loader import load_model

    if not settings.model:
        raise RuntimeError("no model configured: set VLMQ_MODEL (an HF model id or a local path)")
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    db = get_database(settings.database_url)
    store = make_store(settings)
    dtype = getattr(torch, settings.dtype)
    log.info("worker %s loading model %s on %s (%s)", worker_id, settings.model, settings.device, settings.dtype)
    loaded = load_model(settings.model, device=settings.device, dtype=dtype)
    generator = BatchingGenerator(
        HFBatchRunner(loaded), max_batch_size=settings.max_batch_size, batch_wait_s=settings.batch_wait_ms / 1000
    )
    leases = LeaseKeeper(db, worker_id, settings.lease_seconds, settings.heartbeat_seconds)
    pipeline = JobPipeline(settings, db, store, generator, leases, worker_id)
    return WorkerContext(settings, db, store, generator, leases, pipeline, worker_id)


_context: WorkerContext | None = None
_context_lock = threading.Lock()


def get_context(settings: Settings | None = None) -> WorkerContext:
    """The process's context, built on first use (the model loads once per process, not per task)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = build_context(settings or get_settings())
        return _context


def set_context(context: WorkerContext | None) -> None:
    global _context
    with _context_lock:
        _context = context
