"""run_job messages written straight into Redis, in the exact format Celery's send_task gives them there.

Celery's send_task builds each message through signals and routers, then kombu makes a new redis-py client for every
publish: the largest single cost of POST /v1/jobs after the SQL insert (bench/ingest.py). This writes the same JSON
envelope (task protocol 2, kombu's Redis transport: base64 body, the priority step's list `<queue>\\x06\\x16<step>`)
with one pooled redis-py client, many messages in one LPUSH, at a small part of the cost. Consumers cannot tell the
difference (tests/common/broker/test_fast_send.py checks a real Celery worker runs them and compares envelopes field by
field); common/broker/messages.py already reads this format for the republisher.

Only for plain Redis brokers (redis://, rediss://) without a key prefix; anything else goes through Celery.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from collections.abc import Iterable
from typing import Any

import redis

# kombu's Redis transport: priority step n (n > 0) of queue q is the list f"{q}{PRIORITY_SEP}{n}".
PRIORITY_SEP = "\x06\x16"
# Task protocol 2 "embed" part of the body, and the fixed headers of a message with no workflow.
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def usable(broker_url: str, transport_options: dict[str, Any]) -> bool:
    """Whether messages for this broker can be written directly (else send through Celery)."""
    steps = transport_options.get("priority_steps")
    return (broker_url.startswith(("redis://", "rediss://")) and not transport_options.get("global_keyprefix")
            and transport_options.get("sep", PRIORITY_SEP) == PRIORITY_SEP and steps == list(range(10)))


class RedisTaskSender:
    """Thread-safe (redis-py pools its connections); one per process and broker."""

    def __init__(self, broker_url: str) -> None:
        self.client = redis.Redis.from_url(broker_url, socket_timeout=10, socket_connect_timeout=5)
        # As Celery fills them: the sending process, and the app's reply queue (unused: results are ignored).
        self.origin = f"gen{os.getpid()}@{socket.gethostname()}"
        self.reply_to = str(uuid.uuid4())

    def ping(self) -> None:
        """Open a pooled connection now (a process's warm-up), raising redis.RedisError when Redis is down."""
        self.client.ping()

    def message(self, task: str, args: list[Any], queue: str, priority: int) -> str:
        task_id = str(uuid.uuid4())
        body = json.dumps([args, {}, _EMBED]).encode()
        return json.dumps({
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py", "task": task, "id": task_id, "shadow": None, "eta": None, "expires": None,
                "group": None, "group_index": None, "retries": 0, "timelimit": [None, None], "root_id": task_id,
                "parent_id": None, "argsrepr": repr(args), "kwargsrepr": "{}", "origin": self.origin,
                "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
            },
            "properties": {
                "correlation_id": task_id, "reply_to": self.reply_to, "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue}, "priority": priority,
                "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
            },
        })

    def send(self, task: str, args_list: Iterable[list[Any]], queue: str, priority: int) -> int:
        """One message per args in `args_list` to `queue` at Celery priority `priority` (0 is highest on
        Redis), 1,000 to a round trip; raises redis.RedisError when Redis cannot take them."""
        key = f"{queue}{PRIORITY_SEP}{priority}" if priority else queue
        sent = 0
        batch: list[str] = []
        for args in args_list:
            batch.append(self.message(task, args, queue, priority))
            if len(batch) == 1000:
                sent += self._push(key, batch)
        return sent + self._push(key, batch)

    def _push(self, key: str, batch: list[str]) -> int:
        # One LPUSH of many values leaves them in the order of one LPUSH each (consumers BRPOP: FIFO).
        if batch:
            self.client.lpush(key, *batch)
        n = len(batch)
        batch.clear()
        return n
