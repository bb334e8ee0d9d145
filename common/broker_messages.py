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
from typing import Any

import redis

from common.queue import TASK_RUN_JOB

log = logging.getLogger(__name__)

UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"  # delivery tag -> when it was delivered (kombu's, for its own restore)
_SCAN_BATCH = 1000


class BrokerNotInspectable(Exception):
    """This broker cannot be listed (not Redis): the republisher leaves its jobs alone."""


def _job_ids(message: Any) -> list[str]:
    """The job ids a kombu message (dict) carries, if it is a run_job message: one id, or a list of them."""
    if not isinstance(message, dict):
        return []
    headers = message.get("headers") or {}
    if headers.get("task") != TASK_RUN_JOB:
        return []
    try:
        body = message.get("body")
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        first = json.loads(body)[0][0]
    except (ValueError, TypeError, IndexError, KeyError):
        return []
    ids = first if isinstance(first, list) else [first]
    return [job_id for job_id in ids if isinstance(job_id, str)]


def live_job_ids(broker_url: str, queue_prefix: str = "jobs.", unacked_max_age: float | None = None) -> set[str]:
    """Ids of jobs with a run_job message queued or unacked in the Redis broker at `broker_url`.

    With `unacked_max_age`, an unacked message delivered longer ago than that does not count: the worker
    that took it may have been killed before it claimed the job, and Redis would hold the message until the
    visibility timeout (hours). If that worker lives, the message sent again is a duplicate the claim drops."""
    if not broker_url.startswith(("redis://", "rediss://")):
        raise BrokerNotInspectable(broker_url.split("://", 1)[0])
    client = redis.Redis.from_url(broker_url)
    try:
        ids: set[str] = set()
        for key in client.scan_iter(match=f"{queue_prefix}*", count=_SCAN_BATCH):
            if client.type(key) != b"list":
                continue
            for raw in client.lrange(key, 0, -1):
                ids.update(_parse(raw))
        recent: set[bytes] | None = None
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
                ids.update(_job_ids(envelope[0]))
        return ids
    finally:
        client.close()


def _parse(raw: bytes) -> list[str]:
    try:
        return _job_ids(json.loads(raw))
    except ValueError:
        return []
