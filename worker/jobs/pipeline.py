"""One job's path through a worker: claim -> images -> model -> result -> finish. No Celery here.

The order is what makes crashes harmless: a single job's result object is written under a deterministic key
before the row is finished (a batch row has no object: the conditional finish writes its result into the row
itself), and the row is finished before the message is acked, so a crash anywhere leaves either a redelivery
(the job runs again and overwrites the same key) or a finished job (the duplicate claim fails).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from tenacity import Retrying, stop_after_delay, wait_exponential

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.domain.models import TERMINAL_STATUSES, Job, JobStatus
from common.domain.views import chat_completion
from common.images.decode import ImageError
from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectNotFound, ObjectStore, result_key
from worker.inference.batcher import Generator
from worker.inference.generation import Aborted, GenerationResult, InputError
from worker.inference.pixel_budget import PixelBudget
from worker.jobs.image_reader import ImageReader, ImageRef
from worker.jobs.leases import LeaseKeeper
from worker.jobs.request import fetch_images, generation_request, has_images
from worker.jobs.retry import infra_retry
from worker.jobs.solo_gate import SoloGate
from worker.jobs.stage_clock import StageClock
from worker.jobs.state_writer import StateWriter

if TYPE_CHECKING:
    from worker.jobs.prepare_pool import PreparePool

log = logging.getLogger(__name__)



class Ending(enum.StrEnum):
    """How an attempt ended that left the job's status to someone else."""

    SKIPPED = "skipped"  # a duplicate delivery: another worker holds the job, or it has ended
    LOST = "lost"  # the lease was lost or the job cancelled while it ran: its result was refused


@dataclass(frozen=True)
class Outcome:
    status: JobStatus | Ending  # the job's status after this attempt, or how the attempt ended without one
    retry: bool = False
    # Of the job that ran (set on every outcome but a skipped one): what the after-job bookkeeping needs,
    # without a query.
    tenant: str | None = None
    model: str | None = None
    batch_id: str | None = None
    batch_drained: bool = False  # the last job of its batch this worker held: the batch may be done


class JobPipeline:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        store: ObjectStore,
        generator: Generator,
        leases: LeaseKeeper,
        worker_id: str,
        prepare_pool: PreparePool | None = None,
    ) -> None:
        """`prepare_pool`: where image jobs' inputs are prepared instead of the job's thread (only for a generator
        that takes the paged engine's `PreparedInput`)."""
        self.settings = settings
        self.prepare_pool = prepare_pool
        self.db = db
        self.store = store
        self.images = ImageReader(store)
        self.generator = generator
        self.leases = leases
        self.worker_id = worker_id
        self.gate = SoloGate()
        self.pixels = PixelBudget(settings.worker_prepare_pixels)
        self.clock = StageClock()  # CPU per stage of a job, for /metrics (worker/jobs/telemetry.py)
        # Claims and finishes of the jobs in flight, grouped into shared transactions.
        self.writer = StateWriter(db, worker_id, settings.lease_seconds)
        # Storing a finished result outlasts an outage of S3 or SQL; the heartbeat keeps the lease meanwhile.
        self._result_retry = Retrying(stop=stop_after_delay(settings.persist_retry_seconds),
                                      wait=wait_exponential(multiplier=0.2, max=5), reraise=True)

    def run(self, job_id: str) -> Outcome:
        # The common case, one query: claim it unless this would be its last try. A last try runs alone, and
        # is claimed only once through the gate, so that a job waiting there behind a solo run that crashes
        # the process has not spent its last attempt on it.
        with self.gate.shared():
            with self.clock.stage("claim"):
                job = self._claim_shared(job_id)
            if job is not None:
                return self._run_leased(job)
        if not self._claimable_last_try(job_id):
            return Outcome(Ending.SKIPPED)  # a duplicate delivery: someone holds it, or it has ended
        with self.gate.solo():
            job = self._claim(job_id)
            if job is None:
                return Outcome(Ending.SKIPPED)
            return self._run_leased(job)

    def _run_leased(self, job: ClaimedJob) -> Outcome:
        self.leases.add(job.id, job.batch_id)
        return self.run_held(job)

    def run_held(self, job: ClaimedJob, fetched: dict[ImageRef, bytes] | None = None) -> Outcome:
        """Run a job this worker has claimed and whose lease it keeps (leases.add), then let the lease go.
        `fetched`: some of its images, already read (ImageReader.read_many), the rest read here; emptied once
        the job's input is prepared, so that the bytes are not held while the job waits on the model."""
        drained = False
        try:
            outcome = self._run_claimed(job, fetched or {})
        finally:
            drained = self.leases.discard(job.id)
        return replace(outcome, tenant=job.tenant, model=job.model, batch_id=job.batch_id, batch_drained=drained)

    @infra_retry
    def _claimable_last_try(self, job_id: str) -> bool:
        with self.db.session() as session:
            return jobs.is_claimable_last_try(session, job_id)

    @infra_retry
    def _claim_shared(self, job_id: str) -> ClaimedJob | None:
        return self.writer.claim(job_id)

    @infra_retry
    def _claim(self, job_id: str) -> ClaimedJob | None:
        with self.db.session() as session:
            job = jobs.claim(session, job_id, self.worker_id, self.settings.lease_seconds)
            return None if job is None else ClaimedJob.of(job)

    def _run_claimed(self, job: ClaimedJob, fetched: dict[ImageRef, bytes]) -> Outcome:
        if not self.leases.holds(job.id):
            return Outcome(Ending.LOST)  # the lease keeper found it cancelled since its claim: nothing to do
        try:
            prepared = self.prepare(job, fetched)
            fetched.clear()
            with self.clock.stage("engine"):
                result = self.submit(job, prepared).result()
        except Exception as exc:
            return self.end_failed(job, exc)

        # A single REST job's response is an object of its own; a batch row's result is the row itself (the
        # output file and GET /v1/jobs/{id}/result are rendered from it), so a row costs no object write.
        key = None if job.batch_id is not None else result_key(job.id, job.tenant)
        job_result = jobs.JobResult(key, result.text, result.finish_reason, result.prompt_tokens,
                                    result.completion_tokens)
        if key is not None:
            body = chat_completion(
                job.id, job.model, int(job.created_at.timestamp()), result.text, result.finish_reason,
                result.prompt_tokens, result.completion_tokens,
            )
            try:
                with self.clock.stage("persist"):
                    self._result_retry(self._persist, key, body)
            except Exception as exc:
                log.exception("job %s could not be persisted", job.id)
                return self.release(job, "persist_error", f"{type(exc).__name__}: {exc}")
        return self.finish(job, job_result)

    def prepare(self, job: ClaimedJob, fetched: Mapping[ImageRef, bytes]) -> Any:
        """The job's input for the generator: its images read (`fetched` first) and decoded, its prompt
        templated and tokenised, in this thread or, for an image job with a prepare pool, in that pool."""
        if self.prepare_pool is not None and has_images(job.request):
            with self.clock.stage("prepare"):
                return self.prepare_pool.prepare(job.id, job.request, job.priority, job.tenant, fetched)
        with ExitStack() as decoded:
            with self.clock.stage("inputs"):
                images = fetch_images(job.request, self.settings, self.read_image, fetched)
                decoded.enter_context(self.pixels.hold(images.pixels))  # until the inputs are prepared
                request = generation_request(job.id, job.request, job.priority, self.settings, images, job.tenant)
            with self.clock.stage("prepare"):
                return self.generator.prepare(request)

    def submit(self, job: ClaimedJob, prepared: Any) -> Future[GenerationResult]:
        """Hand a held job's prepared input to the generator. Should the job be lost meanwhile, the lease keeper's
        abort may have gone to the generator before this submit, with nothing there yet to stop: it is aborted
        again once submitted. (Lost after the look below, the keeper's own abort comes after the submit.)"""
        future = self.generator.submit(prepared)
        if not self.leases.holds(job.id):
            self.generator.abort(job.id)
        return future

    def aborted_as_lost(self, job: ClaimedJob, error: BaseException) -> bool:
        """Whether `error` is the generator's answer to an abort of a job this worker no longer holds (cancelled,
        or taken over): it ends as lost, with no SQL, never as a failure, and is not run again here."""
        return isinstance(error, Aborted) and not self.leases.holds(job.id)

    def end_failed(self, job: ClaimedJob, exc: Exception) -> Outcome:
        """End a claimed job whose input or generation raised `exc`: refused input fails it for good, anything
        else hands it back to the queue for another attempt. A job aborted because it was lost just ends."""
        if self.aborted_as_lost(job, exc):
            return Outcome(Ending.LOST)
        if isinstance(exc, InputError | ImageError):
            return self.fail(job, "invalid_input", str(exc))
        if isinstance(exc, ObjectNotFound):
            return self.fail(job, "image_missing", f"image object {exc.args[0]} is missing from storage")
        log.error("job %s failed on attempt %d", job.id, job.attempts, exc_info=exc)
        return self.release(job, "worker_error", f"{type(exc).__name__}: {exc}")

    def finish(self, job: ClaimedJob, job_result: jobs.JobResult) -> Outcome:
        """Record a claimed job's result (its object, if any, already stored), retrying SQL trouble for a while
        before handing the job back to the queue."""
        try:
            with self.clock.stage("finish"):
                finished = self._result_retry(self._finish, job.id, job_result)
        except Exception as exc:
            log.exception("job %s could not be persisted", job.id)
            return self.release(job, "persist_error", f"{type(exc).__name__}: {exc}")
        return self.finished(job, job_result, finished)

    def finished(self, job: ClaimedJob, job_result: jobs.JobResult, finished: bool) -> Outcome:
        """The outcome of a finish that was (True) or was not (False) accepted."""
        if not finished:
            log.info("job %s: lease lost or cancelled; result discarded", job.id)
            if job_result.result_key is not None:
                self._drop_orphan(job.id, job_result.result_key)
            return self.lost()
        return Outcome(JobStatus.SUCCEEDED)

    def lost(self) -> Outcome:
        """The outcome of a job found no longer this worker's. Its batch's other rows here may well be cancelled
        too, or whatever took this one over may have taken more: the lease keeper looks at once."""
        self.leases.check_soon()
        return Outcome(Ending.LOST)

    def _drop_orphan(self, job_id: str, key: str) -> None:
        """Delete the result object a refused finish left, if nothing will refer to it: the job ended without
        it (cancelled while it ran, or failed elsewhere). A job another worker holds now, or has finished, writes
        or refers to the same key, so it stays."""
        try:
            with self.db.session() as session:
                status, kept = session.execute(select(Job.status, Job.result_key).where(Job.id == job_id)).one()
            if status in TERMINAL_STATUSES and kept != key:
                self.store.delete(key)
        except Exception:
            log.warning("job %s: could not drop its discarded result %s", job_id, key, exc_info=True)

    @infra_retry
    def read_image(self, ref: ImageRef) -> bytes:
        return self.images.read(ref)

    @infra_retry
    def read_images(self, refs: Iterable[ImageRef]) -> dict[ImageRef, bytes]:
        """The packed images among `refs`, with one request per stretch of a pack (ImageReader.read_many)."""
        return self.images.read_many(refs)

    def _persist(self, key: str, body: dict[str, Any]) -> None:
        self.store.put(key, json.dumps(body).encode(), content_type="application/json")

    def _finish(self, job_id: str, result: jobs.JobResult) -> bool:
        return self.writer.finish(job_id, result)

    def close(self) -> None:
        self.writer.close()
        if self.prepare_pool is not None:
            self.prepare_pool.close()

    @infra_retry
    def fail(self, job: ClaimedJob, code: str, message: str) -> Outcome:
        with self.db.session() as session:
            failed = jobs.fail(session, job.id, self.worker_id, code, message)
        return Outcome(JobStatus.FAILED) if failed else self.lost()

    @infra_retry
    def release(self, job: ClaimedJob, code: str, message: str) -> Outcome:
        with self.db.session() as session:
            status = jobs.release(session, job.id, self.worker_id, code, message)
        if status is None:
            return self.lost()
        return Outcome(status, retry=status == JobStatus.QUEUED)
