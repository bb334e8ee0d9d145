"""OpenAI batch files, line by line: reading input lines and writing output and error lines.

Shared by `vlmq run` (worker/batches/local_run.py) and the ingest/finalize tasks, so a line is accepted or refused,
and a result is written, the same way on a laptop and in the service. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from common.domain import storable
from common.domain.models import Job, JobStatus
from common.domain.schemas import ChatCompletionRequest
from common.domain.views import CompletionRow, row_completion

CHAT_URL = "/v1/chat/completions"
_BOM = b"\xef\xbb\xbf"


@dataclass
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def as_batch_error(self) -> dict[str, Any]:
        """The OpenAI BatchError shape (a failed batch's `errors.data`)."""
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


def iter_lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, str | LineError]]:
    """(line number, text or error) for every non-blank line of a byte stream.

    Memory stays bounded by `max_line_bytes` whatever the stream's size: a longer line is skipped without
    being buffered and reported as one error; a line that is not UTF-8 is one error, not a broken file."""
    buffer = bytearray()
    number = 0
    too_long = False

    def finish() -> str | LineError | None:
        raw = bytes(buffer)
        if too_long or len(raw) > max_line_bytes:
            return LineError(number, None, "line_too_long", f"line {number} is longer than the limit of "
                                                             f"{max_line_bytes} bytes")
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return LineError(number, None, "invalid_utf8", f"line {number} is not valid UTF-8")
        return text if text.strip() else None

    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not too_long:
                if len(buffer) + len(piece) > max_line_bytes + 1:  # +1: a trailing \r is not content
                    too_long = True
                    buffer.clear()
                else:
                    buffer += piece
            if end < 0:
                break
            number += 1
            if buffer.endswith(b"\r"):
                del buffer[-1:]
            item = finish()
            if item is not None:
                yield number, item
            buffer.clear()
            too_long = False
            start = end + 1
    if buffer or too_long:
        number += 1
        item = finish()
        if item is not None:
            yield number, item


def parse_line(number: int, raw: str, seen: set[str] | None = None) -> tuple[str, ChatCompletionRequest] | LineError:
    """Check one input line. With `seen`, a custom_id met before is refused (and every custom_id is added);
    without it the caller checks duplicates (ingestion does it in SQL, to keep memory bounded)."""
    try:
        row = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also integers over 4300 digits, nesting past the stack
        return LineError(number, None, "invalid_json", f"line {number} is not valid JSON: {exc}")
    if not isinstance(row, dict):
        return LineError(number, None, "invalid_line", f"line {number} must be a JSON object")
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, None, "missing_custom_id", f"line {number} needs a non-empty string custom_id",
                         "custom_id")
    if len(custom_id) > 512:
        return LineError(number, None, "invalid_custom_id", f"line {number}: custom_id is longer than 512 "
                                                            "characters", "custom_id")
    if "\x00" in custom_id:  # SQL text cannot hold it; the error names no custom_id for the same reason
        return LineError(number, None, "invalid_custom_id", f"line {number}: custom_id contains a NUL character",
                         "custom_id")
    if not storable.is_valid_text(custom_id):
        return LineError(number, None, "invalid_custom_id", f"line {number}: custom_id contains a lone surrogate "
                         "(\\ud800-\\udfff), which is not valid Unicode text", "custom_id")
    if seen is not None:
        if custom_id in seen:
            return duplicate_error(number, custom_id)
        seen.add(custom_id)
    try:
        storable.check(row)  # the line's other fields go into SQL, messages and output lines too
    except storable.UnstorableValue as exc:
        return LineError(number, custom_id, "invalid_request", f"line {number}: {exc}", "body")
    if row.get("method", "POST") != "POST" or row.get("url", CHAT_URL) != CHAT_URL:
        return LineError(number, custom_id, "invalid_url",
                         f"line {number}: only POST {CHAT_URL} is supported (got {row.get('method', 'POST')} "
                         f"{row.get('url', CHAT_URL)})", "url")
    try:
        return custom_id, ChatCompletionRequest.model_validate(row.get("body"))
    except ValidationError as exc:
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        return LineError(number, custom_id, "invalid_request", f"line {number}: {detail}", "body")


def duplicate_error(number: int, custom_id: str) -> LineError:
    return LineError(number, custom_id, "duplicate_custom_id",
                     f"line {number}: custom_id {custom_id!r} appears more than once in the file", "custom_id")


def refused_line(err: LineError, request_id: str) -> dict[str, Any]:
    """Output/error line of a request that never became a job."""
    return {"id": request_id, "custom_id": err.custom_id, "response": None,
            "error": {"code": err.code, "message": err.message}}


STOPPED_BY = {
    "batch_cancelled": "the batch was cancelled before this request finished",
    "batch_expired": "the batch expired before this request finished",
}


class LineRow(CompletionRow, Protocol):
    """What job_line reads of a job: a Job, or a row of JOB_LINE_COLUMNS."""

    custom_id: str | None
    status: str
    error_code: str | None
    error_message: str | None


# The columns job_line reads: a batch's lines are built from rows of these alone, without the ORM's instances
# and without the requests, the bulk of a row, parsed from JSON as it loads.
JOB_LINE_COLUMNS = (Job.id, Job.custom_id, Job.line, Job.status, Job.model, Job.created_at, Job.result_text,
                    Job.finish_reason, Job.prompt_tokens, Job.completion_tokens, Job.error_code, Job.error_message)


def job_line(job: LineRow, cancelled_code: str = "batch_cancelled") -> dict[str, Any]:
    """Output line of a finished job, OpenAI batch format. A succeeded job's chat.completion is built from its
    row, which holds everything the worker put in the result object; the row is the truth, and reading it
    costs no object GET per line. A failed request carries the error body the endpoint would have answered
    with; a cancelled one says why (`cancelled_code`: batch_cancelled or batch_expired)."""
    line_id = f"batch_req_{job.id}"
    if job.status == JobStatus.SUCCEEDED:
        body = row_completion(job)
        return {"id": line_id, "custom_id": job.custom_id,
                "response": {"status_code": 200, "request_id": job.id, "body": body}, "error": None}
    if job.status == JobStatus.CANCELLED:
        error = {"code": cancelled_code, "message": STOPPED_BY[cancelled_code]}
        return {"id": line_id, "custom_id": job.custom_id, "response": None, "error": error}
    code = job.error_code or job.status
    message = job.error_message or f"request {job.status}"
    # failed: the input was refused (a 400 from the endpoint); dead: the server gave up after retries (500).
    status_code, kind = (400, "invalid_request_error") if job.status == JobStatus.FAILED else (500, "server_error")
    response = {"status_code": status_code, "request_id": job.id,
                "body": {"error": {"message": message, "type": kind, "param": None, "code": code}}}
    return {"id": line_id, "custom_id": job.custom_id, "response": response,
            "error": {"code": code, "message": message}}
