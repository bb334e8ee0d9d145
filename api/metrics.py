"""Prometheus metrics of the API at /metrics: HTTP requests, queue depth per queue, jobs and batches by status,
live processes by role.

Each app has its own registry (tests run many apps in one process). Counts that cost a query are read at
scrape time and kept COUNTS_TTL_S, so several scrapers (or a fast one) cost one GROUP BY per interval.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import AppState
from common.broker.stats import queue_depths
from common.domain.models import Batch, Job
from common.infra.gc_pauses import GcPauseCollector
from common.infra.worker_registry import WorkerRegistry

log = logging.getLogger(__name__)

COUNTS_TTL_S = 10.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

router = APIRouter(tags=["metrics"])


class ApiMetrics:
    def __init__(self, state: AppState, registry: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmq_http_requests", "HTTP requests by method, route and status.",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("vlmq_http_request_duration_seconds", "HTTP request latency by route.",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(state, registry))
        self.registry.register(GcPauseCollector())

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, state: AppState, registry: WorkerRegistry) -> None:
        self.state, self.workers = state, registry
        self._lock = threading.Lock()
        self._counts: tuple[float, dict[str, int], dict[str, int]] | None = None

    def _sql_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            if self._counts is None or time.monotonic() - self._counts[0] > COUNTS_TTL_S:
                with self.state.db.session() as session:
                    jobs = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
                    batches = dict(session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all())
                self._counts = (time.monotonic(), jobs, batches)
            return self._counts[1], self._counts[2]

    def collect(self) -> Iterator[Any]:
        try:
            jobs, batches = self._sql_counts()
        except Exception as exc:  # a scrape must not fail because SQL blinked; readyz reports that
            log.warning("metrics: job counts unavailable: %s", exc)
            jobs, batches = {}, {}
        gauge = GaugeMetricFamily("vlmq_jobs", "Jobs by status (all tenants).", labels=["status"])
        for status in ("queued", "running", "succeeded", "failed", "dead", "cancelled"):
            gauge.add_metric([status], jobs.get(status, 0))
        yield gauge
        gauge = GaugeMetricFamily("vlmq_batches", "Batches by status (all tenants).", labels=["status"])
        for status, n in sorted(batches.items()):
            gauge.add_metric([status], n)
        yield gauge
        try:
            depths = queue_depths(self.state.settings.broker_url)
        except Exception as exc:
            log.warning("metrics: queue depths unavailable: %s", exc)
            depths = {}
        gauge = GaugeMetricFamily("vlmq_queue_depth", "Messages waiting in each broker queue (unacked: taken, "
                                                       "not yet acked); a run_job message carries 1 to "
                                                       "VLMQ_JOB_IDS_PER_MESSAGE jobs (vlmq_jobs counts jobs).",
                                  labels=["queue"])
        for queue, n in sorted(depths.items()):
            gauge.add_metric([queue], n)
        yield gauge
        try:
            records = self.workers.list()
        except Exception as exc:
            log.warning("metrics: process registry unavailable: %s", exc)
            records = []
        gauge = GaugeMetricFamily("vlmq_processes", "Live processes by role (worker, ingest, beat).", labels=["role"])
        roles: dict[str, int] = {"worker": 0, "ingest": 0, "beat": 0}
        for record in records:
            roles[str(record.get("role"))] = roles.get(str(record.get("role")), 0) + 1
        for role, n in sorted(roles.items()):
            gauge.add_metric([role], n)
        yield gauge
        gauge = GaugeMetricFamily("vlmq_worker_tokens_per_second", "Tokens generated per second by each model "
                                  "worker (last stats interval).", labels=["worker_id", "model"])
        for record in records:
            if record.get("role") == "worker":
                gauge.add_metric([str(record.get("id")), str(record.get("model"))],
                                 float(record.get("tokens_per_s", 0)))
        yield gauge


class MetricsMiddleware:
    """Counts every request under its route's path template (bounded label values), or `unmatched`."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    api_metrics: ApiMetrics = request.app.state.metrics
    body = await asyncio.to_thread(api_metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI, state: AppState, registry: WorkerRegistry) -> None:
    """The /metrics route and the request-counting middleware (outermost, so refused bodies count too)."""
    app.state.metrics = ApiMetrics(state, registry)
    app.include_router(router)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
