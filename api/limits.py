"""Per-tenant limits: requests per second (429 + Retry-After) and open jobs (queued or running).

The rate is counted in fixed one-second windows in Redis when the broker is Redis, so every API replica
shares one count per tenant; in embedded mode (one process) the count is kept in memory. If Redis cannot be
reached the request is let through: the broker being down already shows as a 503 where it matters, and a
limiter must not turn an outage into refusals of reads.

Open jobs are counted in SQL at most once per `OPEN_JOBS_TTL` per tenant and process: an exact count per
request would scan a million-row index range for a tenant with a million jobs queued. Submissions let through
meanwhile are added to the cached count, one at a time per tenant, so one process cannot overshoot; several API
replicas can, by up to a second's worth of each other's submissions.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import func, select

from api.auth import get_tenant
from api.deps import AppState, get_state
from common.domain.models import Job, JobStatus

log = logging.getLogger(__name__)

OPEN_JOBS_TTL = 1.0


class RateLimiter:
    def __init__(self, per_second: int, broker_url: str) -> None:
        self.per_second = per_second
        self._redis = redis.Redis.from_url(broker_url, socket_timeout=0.5) if broker_url.startswith(
            ("redis://", "rediss://")) else None
        self._local: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def allow(self, tenant: str) -> bool:
        if self.per_second <= 0:
            return True
        window = int(time.time())
        if self._redis is not None:
            key = f"vlmq:rate:{tenant}:{window}"
            try:
                pipe = self._redis.pipeline()
                pipe.incr(key)
                pipe.expire(key, 2)
                count, _ = pipe.execute()
            except redis.RedisError:
                log.warning("rate limiter cannot reach Redis; letting requests through")
                return True
            return int(count) <= self.per_second
        with self._lock:
            if len(self._local) > 10_000:
                self._local = {k: v for k, v in self._local.items() if k[1] >= window}
            count = self._local[(tenant, window)] = self._local.get((tenant, window), 0) + 1
        return count <= self.per_second


class OpenJobsCounter:
    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, float]] = {}  # tenant -> (open jobs, counted until)
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def reserve(self, state: AppState, tenant: str, limit: int) -> int:
        """The tenant's open jobs before this submission; under `limit`, the submission is counted in.

        One tenant's submissions pass one at a time: of a burst that finds the count stale, one counts in SQL
        and the rest read its count, each adding itself, so a burst cannot overshoot in one process."""
        with self._lock:
            tenant_lock = self._locks.setdefault(tenant, threading.Lock())
        with tenant_lock:
            now = time.monotonic()
            cached = self._cache.get(tenant)
            if cached is not None and cached[1] > now:
                count, until = cached
            else:
                count, until = self._count(state, tenant), now + OPEN_JOBS_TTL
            self._cache[tenant] = (count + 1 if count < limit else count, until)
            return count

    @staticmethod
    def _count(state: AppState, tenant: str) -> int:
        with state.db.session() as session:
            return int(session.scalar(select(func.count()).select_from(Job).where(
                Job.tenant == tenant, Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))) or 0)


async def rate_limit(request: Request, tenant: Annotated[str, Depends(get_tenant)]) -> None:
    limiter: RateLimiter = request.app.state.rate_limiter
    allowed = await run_in_threadpool(limiter.allow, tenant) if limiter.per_second > 0 else True
    if not allowed:
        raise HTTPException(429, f"tenant {tenant!r} is over its limit of {limiter.per_second} requests per "
                                 "second; retry after the time in Retry-After", headers={"Retry-After": "1"})


async def open_jobs_guard(request: Request, state: Annotated[AppState, Depends(get_state)],
                          tenant: Annotated[str, Depends(get_tenant)]) -> None:
    """Refuse new work (a job or a batch) while the tenant has its limit of jobs open."""
    limit = state.settings.tenant_max_open_jobs
    if limit <= 0:
        return  # async, so that with no limit a submission does not pay a trip to the thread pool for this
    counter: OpenJobsCounter = request.app.state.open_jobs
    open_jobs = await run_in_threadpool(counter.reserve, state, tenant, limit)
    if open_jobs >= limit:
        raise HTTPException(429, f"tenant {tenant!r} has {open_jobs} jobs queued or running, its limit is {limit};"
                                 " submit more once some have finished", headers={"Retry-After": "30"})
