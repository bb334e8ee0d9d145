"""POST /v1/chat/completions: one request answered synchronously, as OpenAI's endpoint answers it.

The request becomes a job like any POST /v1/jobs (the same checks, queue and engine) at the highest
priority, and the answer waits until the job ends: its chat.completion, or an error in OpenAI's shape. Past
`chat_wait_seconds` the answer is a 504 naming the job, which carries on; so does a job whose client went away.
Streaming is not offered: `stream: true` is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from api.auth import TenantDep
from api.deps import StateDep
from api.errors import error_body, error_responses
from api.job_intake import submit
from api.job_waiter import EndedJob, JobWaiter
from api.json_body import INLINE_BODY_BYTES, body_schema, load_object, validate
from api.limits import open_jobs_guard
from common.domain.models import JobStatus
from common.domain.schemas import ChatCompletion, ChatCompletionRequest
from common.domain.views import chat_completion

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/chat", tags=["chat"])

# The top of POST /v1/jobs' 0-9: someone is waiting on the answer. Batch rows run at `batch_priority`.
INTERACTIVE_PRIORITY = 9
# Nginx's status for a request whose client closed the connection first; only the metrics ever see it.
CLIENT_CLOSED = 499

_DOC = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": body_schema(ChatCompletionRequest),
    "example": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}}}}}
Unended = Literal["timed_out", "client_gone"]


@router.post(
    "/completions", response_model=ChatCompletion, dependencies=[Depends(open_jobs_guard)], openapi_extra=_DOC,
    responses=error_responses(400, 404, 409, 413, 415, 500, 504))
async def create_chat_completion(
    request: Request, state: StateDep, tenant: TenantDep,
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise HTTPException(415, f"unsupported content type {content_type or '(none)'!r}: send application/json")
    raw = await request.body()
    large = len(raw) > INLINE_BODY_BYTES
    payload = await run_in_threadpool(load_object, raw) if large else load_object(raw)
    if payload.get("stream") is True:
        return JSONResponse(error_body("stream: true is not supported; send the request without it (the whole "
                                       "answer comes at once)", "unsupported_value", param="stream"), 400)
    req = await run_in_threadpool(validate, payload, ChatCompletionRequest) if large else validate(
        payload, ChatCompletionRequest)
    view, _ = await submit(request, state, tenant, req, idempotency_key, large=large,
                           priority=INTERACTIVE_PRIORITY)
    job_id = json.loads(view)["id"]
    waiter: JobWaiter = request.app.state.job_waiter
    job = await _wait(request, waiter, job_id, state.settings.chat_wait_seconds)
    if isinstance(job, EndedJob):
        return _answer(job)
    if job == "client_gone":
        return Response(status_code=CLIENT_CLOSED)
    return _error(job_id, 504, f"job {job_id} has not ended after {state.settings.chat_wait_seconds:g} s; it "
                  f"carries on: poll GET /v1/jobs/{job_id}, then fetch GET /v1/jobs/{job_id}/result",
                  "timeout", "server_error", {"Location": f"/v1/jobs/{job_id}"})


async def _wait(request: Request, waiter: JobWaiter, job_id: str, limit_s: float) -> EndedJob | Unended:
    """The ended job, or why there is none: past `limit_s`, or the client went away first (the job runs on
    either way)."""
    ended = asyncio.ensure_future(waiter.wait(job_id))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait((ended, gone), timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (ended, gone):
            task.cancel()
    if ended in done:
        return ended.result()
    if gone in done:
        log.info("job %s: the client went away before it ended; it carries on", job_id)
        return "client_gone"
    return "timed_out"


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read: nothing else can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _answer(job: EndedJob) -> Response:
    if job.status == JobStatus.SUCCEEDED:
        body = chat_completion(job.id, job.model, int(job.created_at.timestamp()), job.result_text or "",
                               job.finish_reason or "stop", job.prompt_tokens or 0, job.completion_tokens or 0)
        return JSONResponse(body, headers={"x-request-id": job.id})
    if job.status == JobStatus.CANCELLED:
        return _error(job.id, 409, f"job {job.id} was cancelled before it ended", "job_cancelled")
    message = f"job {job.id} {job.status}: {job.error_message or job.error_code or 'no reason recorded'}"
    # failed: the worker refused the input (an image it cannot decode, say), as the batch output has it;
    # dead: the server gave up after its own retries.
    if job.status == JobStatus.FAILED:
        return _error(job.id, 400, message, job.error_code or "invalid_input")
    return _error(job.id, 500, message, job.error_code or "job_dead", "server_error")


def _error(job_id: str, status: int, message: str, code: str, type_: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    # x-should-retry (the openai client obeys it): sending the request again makes a second job, while this
    # one ended for good or still runs.
    extra: dict[str, Any] = {"x-request-id": job_id, "x-should-retry": "false", **(headers or {})}
    return JSONResponse(error_body(message, code, type_), status_code=status, headers=extra)
