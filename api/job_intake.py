"""A validated chat-completions request made a queued, dispatched job: what POST /v1/jobs and
POST /v1/chat/completions share, so both check, store and send a job the same way."""

from __future__ import annotations

import logging
from functools import partial

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from api.deps import AppState
from api.job_writer import JobWriter
from common.broker import dispatch
from common.broker.queue import send_run_job
from common.domain.jobs import NewJob
from common.domain.schemas import ChatCompletionRequest
from common.domain.submission import job_fields, needs_session, submit_job
from common.domain.views import job_view

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 5  # a JobCreate brings its own


async def submit(request: Request, state: AppState, tenant: str, req: ChatCompletionRequest,
                 idempotency_key: str | None, *, large: bool, priority: int = DEFAULT_PRIORITY) -> tuple[str, bool]:
    """(the job as JSON, created). `large`: the request is big enough that checking it belongs in the thread
    pool. With an Idempotency-Key already used, the tenant's earlier job and False."""
    if idempotency_key is not None:
        return await run_in_threadpool(_create, state, tenant, req, idempotency_key, priority)
    # Jobs without images to resolve are checked right here; others look them up (or store them) in a
    # session of their own.
    if needs_session(req, tenant):
        fields = await run_in_threadpool(_fields_with_images, state, tenant, req, priority)
    elif large:
        fields = await run_in_threadpool(job_fields, None, state.store, state.settings, req, priority=priority,
                                         tenant=tenant)
    else:
        fields = job_fields(None, state.store, state.settings, req, priority=priority, tenant=tenant)
    writer: JobWriter = request.app.state.job_writer
    return await writer.write(fields), True


def _fields_with_images(state: AppState, tenant: str, req: ChatCompletionRequest, priority: int) -> NewJob:
    with state.db.session() as session:
        return job_fields(session, state.store, state.settings, req, priority=priority, tenant=tenant)


def _create(state: AppState, tenant: str, req: ChatCompletionRequest, idempotency_key: str,
            priority: int) -> tuple[str, bool]:
    """Write the job, then send its run_job message. One trip to the thread pool for both: each trip costs a
    context switch and GIL hand-offs, a visible share of a request's CPU."""
    with state.db.session() as session:
        job, created = submit_job(session, state.store, state.settings, req, priority=priority,
                                  idempotency_key=idempotency_key, tenant=tenant)
        view, job_priority = job_view(job), job.priority
    if created:
        dispatch.send_or_mark_unsent(state.db, [view.id], partial(
            send_run_job, state.celery, state.settings, view.id, job_priority))
    return view.model_dump_json(), created
