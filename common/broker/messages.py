"""Which run_job messages the broker holds right now: what the republisher compares SQL against.

Redis (Celery's kombu transport) keeps a queue as one list per priority step (`<queue>` and
`<queue>\\x06\\x16<step>`), and messages a worker has taken but not acked in the `unacked` hash (also those it
holds for a delayed retry). A job whose message is in neither was lost (a Redis restart without persistence,
a flushed key) and must be sent again. Fair dispatch keeps this set small: a window per tenant and model.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from common.broker.queue import INGEST_QUEUE, TASK_INGEST_BATCH, TASK_RUN_JOB

log = logging.getLogger(__name__)

UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"  # delivery tag -> when it was delivered (kombu's, for its own restore)
_SCAN_BATCH = 1000


# The ids a message (a decoded kombu message dict) carries for what is being looked for.
IdsOf = Callable[[Any], list[str]]


class BrokerNotInspectable(Exception):
    """This broker cannot be listed (not Redis): the republisher leaves its jobs alone."""


def _first_arg(message: Any, task: str) -> Any:
    """The first argument of a kombu message (dict) of `task`, else None."""
    if not isinstance(message, dict):
        return None
    headers = message.get("headers") or {}
    if headers.get("task") != task:
        return None
    try:
        body: Any = message.get("body")  # decoded and parsed as it comes: what is malformed raises below
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return json.loads(body)[0][0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None


def _job_ids(message: Any) -> list[str]:
    """The job ids a kombu message (dict) carries, if it is a run_job message: one id, or a list of them."""
    first = _first_arg(message, TASK_RUN_JOB)
    ids = first if isinstance(first, list) else [first]
    return [job_id for job_id in ids if isinstance(job_id, str)]


def _ingested_batch_ids(message: Any) -> list[str]:
    batch_id = _first_arg(message, TASK_INGEST_BATCH)
    return [batch_id] if isinstance(batch_id, str) else []


def live_job_ids(broker_url: str, queue_prefix: str = "jobs.", unacked_max_age: float | None = None) -> set[str]:
    """Ids of jobs with a run_job message queued or unacked in the Redis broker at `broker_url`.

    With `unacked_max_age`, an unacked message delivered longer ago than that does not count: the worker
    that took it may have been killed before it claimed the job, and Redis would hold the message until the
    visibility timeout (hours). If that worker lives, the message sent again is a duplicate the claim drops."""
    return _live(broker_url, queue_prefix, unacked_max_age, _job_ids)


def live_ingested_batch_ids(broker_url: str) -> set[str]:
    """Ids of batches with an ingest_batch message queued or unacked (however long ago it was taken: an
    ingestion may run for many minutes) in the Redis broker at `broker_url`."""
    return _live(broker_url, INGEST_QUEUE, None, _ingested_batch_ids)


def _live(broker_url: str, queue_prefix: str, unacked_max_age: float | None, ids_of: IdsOf) -> set[str]:
    if not broker_url.startswith(("redis://", "rediss://")):
        raise BrokerNotInspectable(broker_url.split("://", 1)[0])
    client = redis.Redis.from_url(broker_url)
    try:
        ids: set[str] = set()
        for key in client.scan_iter(match=f"{queue_prefix}*", count=_SCAN_BATCH):
            if client.type(key) != b"list":
                continue
            for raw in client.lrange(key, 0, -1):
                ids.update(_parse(raw, ids_of))
        recent: set[Any] | None = None  # delivery tags
        if unacked_max_age is not None:
            recent = set(client.zrangebyscore(UNACKED_INDEX_KEY, time.time() - unacked_max_age, "+inf"))
        for tag, raw in client.hscan_iter(UNACKED_KEY, count=_SCAN_BATCH):
            if recent is not None and tag not in recent:
                continue
            try:
                envelope = json.loads(raw)
            except ValueError:
                continue
            if isinstance(envelope, list) and envelope:
                ids.update(ids_of(envelope[0]))
        return ids
    finally:
        client.close()


def _parse(raw: bytes | str, ids_of: IdsOf) -> list[str]:
    try:
        return ids_of(json.loads(raw))
    except ValueError:
        return []
