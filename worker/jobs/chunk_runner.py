"""The rows of one run_job message as one chunk: claimed together, fed to the engine from the message's thread,
finished in bulk as each result arrives.

A batch row is small work for the queue to carry: per row, a thread of its own, its own claim and finish
hand-offs and their waits cost more of the worker's GIL than preparing the row does. So a chunk's rows are
claimed in one group (common.domain.jobs.claim_many, under one lease time); the packed images of all of them are
read with one request per pack (worker/jobs/image_reader.py: rows ingested together have theirs side by side);
each batch row is decoded, templated, tokenised and submitted in turn on the message's thread; and as the engine
ends each, its result is queued to the state writer, whose group commit records the chunk's finished rows in
bulk UPDATEs as they finish, not at the chunk's end. No thread waits on a row.

Rows that need more go to the job pool (worker/jobs/group.py) and run as a message of their own would: image rows
when a prepare pool does their work in other processes (their threads wait on it in parallel), single REST jobs
(a result object to write first), and rows the chunk's claim did not take (a duplicate delivery, or a last try,
which runs alone behind the solo gate). Crash safety is the pipeline's: a row's finish is conditional on its
lease, so a worker killed mid-chunk loses only its unfinished rows' work, which runs again after the reaper or
redelivery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

from common.domain import jobs
from common.domain.claimed_job import ClaimedJob
from common.infra.logs import log_fields
from worker.inference.generation import GenerationResult
from worker.jobs.group import JobGroupRunner, OnJobDone
from worker.jobs.image_reader import ImageRef, image_refs
from worker.jobs.pipeline import Ending, JobPipeline, Outcome
from worker.jobs.retry import infra_retry

log = logging.getLogger(__name__)


# Packed image bytes one chunk reads ahead for its rows; a row past it reads its own when it is prepared.
MAX_CHUNK_IMAGE_BYTES = 64 * 1024 * 1024


def _image_refs(claim: ClaimedJob) -> list[ImageRef]:
    """A row's images, or none where its stored request cannot say (its own prepare then refuses it)."""
    try:
        return image_refs(claim.request)
    except (KeyError, TypeError, ValueError):
        return []


class _Chunk:
    """The rows of one chunk that are in flight on the fast path: counts them down as they end."""

    def __init__(self, on_job_done: OnJobDone | None) -> None:
        self.on_job_done = on_job_done
        self.outcomes: dict[str, Outcome | Exception] = {}
        self._open = 0
        self._lock = threading.Lock()
        self._all_ended = threading.Event()
        self._all_ended.set()

    def open(self) -> None:
        with self._lock:
            self._open += 1
            self._all_ended.clear()

    def end(self, job_id: str, outcome: Outcome | Exception) -> None:
        with self._lock:
            self.outcomes[job_id] = outcome
        if self.on_job_done is not None:
            try:
                self.on_job_done(job_id, outcome)
            except Exception:  # the row has ended whatever its follow-up does; the chunk must not hang
                log.exception("job %s: its follow-up failed", job_id)
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._all_ended.set()

    def wait(self) -> None:
        self._all_ended.wait()


class ChunkRunner:
    def __init__(self, pipeline: JobPipeline, pool: JobGroupRunner) -> None:
        self.pipeline = pipeline
        self.pool = pool

    def run(self, job_ids: list[str], on_job_done: OnJobDone | None = None) -> list[Outcome | Exception]:
        """Each row's outcome, or the exception that kept it from being claimed (SQL unreachable), in order;
        `on_job_done(job_id, outcome)` is called as each ends, on whichever thread ended it."""
        pipeline = self.pipeline
        unique = list(dict.fromkeys(job_ids))
        chunk = _Chunk(on_job_done)
        elsewhere: dict[str, Future[Outcome]] = {}
        to_pool: list[ClaimedJob] = []  # rows that run on the job pool, each in a thread
        here: list[ClaimedJob] = []  # rows this thread prepares and submits, then leaves to callbacks
        with pipeline.gate.shared():
            with pipeline.clock.stage("claim", calls=len(unique)):
                claims = self._claim(unique)
            for job_id in unique:
                claim = claims[job_id]
                if isinstance(claim, Exception):
                    chunk.open()
                    chunk.end(job_id, claim)
                elif claim is None:
                    # Not taken: run as its own message would, after this chunk lets the gate go (a last try
                    # waits there for every shared run to end, this chunk's included).
                    continue
                else:
                    pipeline.leases.add(job_id, claim.batch_id)
                    # A prepare pool's processes do an image row's work in parallel: its thread only waits.
                    if claim.batch_id is None or (pipeline.prepare_pool is not None and _image_refs(claim)):
                        to_pool.append(claim)
                    else:
                        here.append(claim)
            fetched = self._read_packed_images(to_pool + here)
            for claim in to_pool:
                elsewhere[claim.id] = self.pool.submit(partial(pipeline.run_held, fetched=fetched.pop(claim.id)),
                                                       claim, on_job_done)
            for claim in here:
                chunk.open()
                self._start(claim, chunk, fetched.pop(claim.id))
            chunk.wait()
            for future in list(elsewhere.values()):
                future.exception()  # the gate is held until every row this chunk claimed has ended
        for job_id in unique:
            if claims[job_id] is None:
                elsewhere[job_id] = self.pool.submit(pipeline.run, job_id, on_job_done)
        outcomes: list[Outcome | Exception] = []
        reported: set[str] = set()
        for job_id in job_ids:
            if job_id in reported:
                outcomes.append(Outcome(Ending.SKIPPED))  # named twice in one message: it ran once
                continue
            reported.add(job_id)
            if job_id in chunk.outcomes:
                outcomes.append(chunk.outcomes[job_id])
            else:
                outcomes.append(self.pool.outcome(elsewhere[job_id]))
        return outcomes

    @infra_retry
    def _claim_all(self, job_ids: list[str]) -> dict[str, ClaimedJob | Exception | None]:
        claims = self.pipeline.writer.claim_all(job_ids)
        if any(isinstance(claim, Exception) for claim in claims.values()) and not any(
                isinstance(claim, ClaimedJob) for claim in claims.values()):
            raise next(claim for claim in claims.values() if isinstance(claim, Exception))
        return claims

    def _claim(self, job_ids: list[str]) -> dict[str, ClaimedJob | Exception | None]:
        try:
            return self._claim_all(job_ids)
        except Exception as exc:
            return dict.fromkeys(job_ids, exc)

    def _read_packed_images(self, claims: list[ClaimedJob]) -> dict[str, dict[ImageRef, bytes]]:
        """Per row, its packed images read together with the chunk's others (rows ingested together have theirs
        side by side in one pack), up to MAX_CHUNK_IMAGE_BYTES in all. What is not read here each row reads,
        and reports, for itself; each row's share is dropped once it is prepared."""
        wanted: dict[str, list[ImageRef]] = {}
        budget = MAX_CHUNK_IMAGE_BYTES
        for claim in claims:
            refs = [ref for ref in _image_refs(claim) if ref.pack is not None]
            size = sum(ref.pack.size for ref in refs if ref.pack is not None)
            if refs and size <= budget:
                wanted[claim.id], budget = refs, budget - size
        read: dict[ImageRef, bytes] = {}
        if wanted:
            try:
                with self.pipeline.clock.stage("inputs", calls=0):  # each row's own inputs stage counts the call
                    read = self.pipeline.read_images(ref for refs in wanted.values() for ref in refs)
            except Exception as exc:
                log.warning("could not read the images of %d rows together (%s: %s); each reads its own",
                            len(wanted), type(exc).__name__, exc)
        return {claim.id: {ref: read[ref] for ref in wanted.get(claim.id, ()) if ref in read} for claim in claims}

    def _start(self, job: ClaimedJob, chunk: _Chunk, fetched: dict[ImageRef, bytes]) -> None:
        """Prepare and submit one claimed batch row; its end comes through callbacks."""
        pipeline = self.pipeline
        if not pipeline.leases.holds(job.id):
            # Cancelled since the chunk's claim (the lease keeper found it): the rows of a chunk are prepared one
            # after another, and those not reached yet cost nothing more.
            self._end(job, chunk, Outcome(Ending.LOST))
            return
        try:
            prepared = pipeline.prepare(job, fetched)
            with pipeline.clock.stage("engine"):  # the hand-off: the model's own time is the engine's CPU
                future = pipeline.submit(job, prepared)
        except Exception as exc:
            self._end_on_pool(job, chunk, pipeline.end_failed, job, exc)
            return
        future.add_done_callback(partial(self._generated, job, chunk))

    def _generated(self, job: ClaimedJob, chunk: _Chunk, future: Future[GenerationResult]) -> None:
        """On the engine's result thread (or the submitting one): never block here."""
        error = future.exception()
        if error is not None and self.pipeline.aborted_as_lost(job, error):
            self._end(job, chunk, Outcome(Ending.LOST))  # cancelled or taken over: no SQL, nothing to block on
            return
        if error is not None:  # ended as a job thread's would: refused input fails, the rest retries
            failure = error if isinstance(error, Exception) else RuntimeError(repr(error))
            self._end_on_pool(job, chunk, self.pipeline.end_failed, job, failure)
            return
        result = future.result()
        job_result = jobs.JobResult(None, result.text, result.finish_reason, result.prompt_tokens,
                                    result.completion_tokens)
        try:
            with self.pipeline.clock.stage("finish"):  # the hand-off: the group's SQL is the writer's
                finish = self.pipeline.writer.finish_later(job.id, job_result)
        except Exception:  # the writer is closing: finish the slow way
            self._end_on_pool(job, chunk, self.pipeline.finish, job, job_result)
            return
        finish.add_done_callback(partial(self._finished, job, job_result, chunk))

    def _finished(self, job: ClaimedJob, job_result: jobs.JobResult, chunk: _Chunk, finish: Future[bool]) -> None:
        """On the state writer's thread: never block here. A failed group write is retried on the pool."""
        if finish.exception() is not None:
            self._end_on_pool(job, chunk, self.pipeline.finish, job, job_result)
            return
        self._end(job, chunk, self.pipeline.finished(job, job_result, finish.result()))

    def _end_on_pool(self, job: ClaimedJob, chunk: _Chunk, work: Callable[..., Outcome], *args: object) -> None:
        """Blocking ends (SQL with retries) of rare rows run on the job pool, off the engine's and writer's
        threads."""
        def run() -> None:
            try:
                with log_fields(job_id=job.id):
                    outcome: Outcome | Exception = work(*args)
            except Exception as exc:
                outcome = exc
            self._end(job, chunk, outcome)

        self.pool.submit_call(run)

    def _end(self, job: ClaimedJob, chunk: _Chunk, outcome: Outcome | Exception) -> None:
        drained = self.pipeline.leases.discard(job.id)
        if isinstance(outcome, Outcome):
            outcome = replace(outcome, tenant=job.tenant, model=job.model, batch_id=job.batch_id,
                              batch_drained=drained)
        chunk.end(job.id, outcome)

