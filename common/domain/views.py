"""How a job looks from outside: the API's job object and the OpenAI chat.completion body."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from common.domain.models import Job, JobStatus
from common.domain.schemas import JobError, JobResultView, JobView, Usage


def job_view(job: Job) -> JobView:
    result = None
    if job.status == JobStatus.SUCCEEDED:
        prompt, completion = job.prompt_tokens or 0, job.completion_tokens or 0
        result = JobResultView(
            text=job.result_text or "",
            finish_reason=job.finish_reason or "stop",
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
        )
    error = JobError(code=job.error_code, message=job.error_message or "") if job.error_code else None
    return JobView(
        id=job.id, status=job.status, model=job.model, priority=job.priority, created_at=job.created_at,
        started_at=job.started_at, finished_at=job.finished_at, attempts=job.attempts,
        max_attempts=job.max_attempts, metadata=job.metadata_, batch_id=job.batch_id, custom_id=job.custom_id,
        result=result, error=error,
    )


def chat_completion(
    job_id: str, model: str, created: int, text: str, finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{job_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class CompletionRow(Protocol):
    """What row_completion reads of a job: a Job, or a row of just these columns."""

    id: str
    model: str
    created_at: datetime
    result_text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None


def row_completion(job: CompletionRow) -> dict[str, Any]:
    """A succeeded job's chat.completion built from its row, which holds everything a result object would."""
    return chat_completion(job.id, job.model, int(job.created_at.timestamp()), job.result_text or "",
                           job.finish_reason or "stop", job.prompt_tokens or 0, job.completion_tokens or 0)
