"""Live records of the running processes (model workers, ingest workers, beat) for the status page, the API's
metrics and the container healthchecks.

Each process publishes a small JSON record every `stats_interval_seconds` under `vlmq:proc:<id>` in the
broker's Redis, with a TTL of three intervals: a process that dies or hangs drops off by itself, and nothing
here is ever the truth about jobs (SQL is). With the in-process broker (embedded mode) the API and the worker
share one process, so a dict stands in for Redis.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

KEY_PREFIX = "vlmq:proc:"
TTL_INTERVALS = 3

_local: dict[str, tuple[float, dict[str, Any]]] = {}  # embedded mode: id -> (expires at, record)
_local_lock = threading.Lock()


class WorkerRegistry:
    def __init__(self, broker_url: str) -> None:
        self._redis = (redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
                       if broker_url.startswith(("redis://", "rediss://")) else None)

    def publish(self, record: dict[str, Any], ttl_seconds: float) -> None:
        key = KEY_PREFIX + record["id"]
        if self._redis is None:
            with _local_lock:
                _local[key] = (time.time() + ttl_seconds, record)
            return
        self._redis.set(key, json.dumps(record), px=max(1, int(ttl_seconds * 1000)))

    def remove(self, process_id: str) -> None:
        key = KEY_PREFIX + process_id
        if self._redis is None:
            with _local_lock:
                _local.pop(key, None)
            return
        self._redis.delete(key)

    def list(self) -> list[dict[str, Any]]:
        """Every live record, oldest process first."""
        if self._redis is None:
            now = time.time()
            with _local_lock:
                records = [r for expires, r in _local.values() if expires > now]
        else:
            keys = list(self._redis.scan_iter(match=KEY_PREFIX + "*", count=1000))
            values = self._redis.mget(keys) if keys else []
            records = []
            for raw in values:
                if not raw:
                    continue  # expired between SCAN and MGET
                try:
                    records.append(json.loads(raw))
                except ValueError:
                    continue
        return sorted(records, key=lambda r: (r.get("started_at", 0), r.get("id", "")))

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


def process_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


class Heartbeat:
    """A daemon thread publishing `{id, role, host, pid, started_at, updated_at, **stats()}` every interval."""

    def __init__(self, registry: WorkerRegistry, role: str, interval_s: float,
                 stats: Callable[[], dict[str, Any]] | None = None, process: str | None = None) -> None:
        self.registry, self.role, self.interval_s = registry, role, interval_s
        self.stats = stats or dict
        self.id = process or process_id(role)
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"vlmq-heartbeat-{role}", daemon=True)

    def start(self) -> Heartbeat:
        self.publish()
        self._thread.start()
        return self

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "role": self.role, "host": socket.gethostname(), "pid": os.getpid(),
                "started_at": self.started_at, "updated_at": time.time(), **self.stats()}

    def publish(self) -> None:
        try:
            self.registry.publish(self.record(), self.interval_s * TTL_INTERVALS)
        except Exception as exc:  # Redis away for a moment: the record expires, the healthcheck notices
            log.warning("could not publish %s stats: %s", self.role, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + 5)
        with contextlib.suppress(Exception):  # it expires anyway
            self.registry.remove(self.id)


def start_heartbeat(broker_url: str, role: str, interval_s: float,
                    stats: Callable[[], dict[str, Any]] | None = None) -> Heartbeat:
    return Heartbeat(WorkerRegistry(broker_url), role, interval_s, stats).start()
