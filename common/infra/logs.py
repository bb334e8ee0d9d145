"""Logging set-up for every vlmq process: plain text, or one JSON object per line (`VLMQ_LOG_FORMAT=json`).

Log lines carry the ids of what they are about (`job_id`, `batch_id`) without every call passing them: a
context variable holds the fields of the task now running in this thread (set around each Celery task by
`install_task_log_fields`, or by `log_fields`), and a filter copies them onto each record.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

_fields: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("vlmq_log_fields", default={})  # noqa: B039
# Record attributes every LogRecord has; anything else on a record came from `extra=` and is logged too.
# uvicorn's color_message repeats the message with terminal colours.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


@contextmanager
def log_fields(**fields: str | None) -> Iterator[None]:
    """Add fields (job_id=..., batch_id=...) to every record logged in this context."""
    token = _fields.set({**_fields.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _fields.reset(token)


class FieldsFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _fields.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, exception, and any extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(log_format: str, level: str | int = "INFO") -> None:
    """Root logger to stderr in the chosen format; in json mode Celery is told to leave logging alone."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(FieldsFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        from celery.signals import setup_logging

        # A receiver on setup_logging makes Celery skip its own handlers (which would print plain text).
        setup_logging.connect(_leave_logging_alone, weak=False)
    else:
        handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(name)s] %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def _leave_logging_alone(**_: object) -> None:
    return None


def install_task_log_fields() -> None:
    """Around every Celery task in this process: job_id for run_job, batch_id for the batch tasks."""
    from celery.signals import task_postrun, task_prerun

    from common.broker.queue import BATCH_TASKS, TASK_RUN_JOB

    tokens: dict[str, contextvars.Token[dict[str, str]]] = {}

    def before(task_id: str | None = None, task: Any = None, args: Any = None, **_: object) -> None:
        name = getattr(task, "name", "")
        first = str(args[0]) if args and not isinstance(args[0], list) else None
        fields = {"task_id": task_id}
        if name == TASK_RUN_JOB:
            fields["job_id"] = first  # a message of several jobs: each job's thread logs its own
        elif name in BATCH_TASKS:
            fields["batch_id"] = first
        if task_id is not None:
            tokens[task_id] = _fields.set({**_fields.get(), **{k: v for k, v in fields.items() if v}})

    def after(task_id: str | None = None, **_: object) -> None:
        token = tokens.pop(task_id or "", None)
        if token is not None:
            try:
                _fields.reset(token)
            except ValueError:  # set in another context (should not happen with the threads pool)
                _fields.set({})

    task_prerun.connect(before, weak=False)
    task_postrun.connect(after, weak=False)


def setup_process_logging(log_format: str, level: str | int = "INFO") -> None:
    """What a `vlmq` service command calls first: JSON logs with task ids when asked; plain text stays as
    Celery and uvicorn print it."""
    if log_format == "json":
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # bars are not log lines
        configure_logging("json", level)
        logging.captureWarnings(True)
        install_task_log_fields()


def celery_flags(log_format: str) -> list[str]:
    """Celery's global options before the sub-command: no start-up banner (plain text) in json mode."""
    return ["--quiet"] if log_format == "json" else []


def route_library_logs(log_format: str) -> None:
    """After the model stack is imported: transformers prints through its own handler; send it to ours."""
    module = sys.modules.get("transformers")
    if log_format == "json" and module is not None:
        module.utils.logging.disable_default_handler()
        module.utils.logging.enable_propagation()


def uvicorn_log_config(log_format: str) -> dict[str, Any] | None:
    """uvicorn's own logging config, or none in json mode (its loggers then reach the JSON root handler)."""
    if log_format == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
