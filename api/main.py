"""The vlmq HTTP API. It never imports torch or worker code; it writes rows and objects and sends tasks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import KeyCache, get_tenant
from api.body_timeout import BodyIdleTimeout
from api.deps import AppState
from api.errors import BodySizeLimit, error_responses, install_error_handlers
from api.job_waiter import JobWaiter
from api.job_writer import JobWriter
from api.limits import OpenJobsCounter, RateLimiter, rate_limit
from api.metrics import install_metrics
from api.routes import batches, chat, datasets, files, health, images, jobs, models, status
from common.broker.queue import make_celery
from common.domain.served_model import served_model
from common.images.decode import register_image_plugins
from common.infra.db import get_database
from common.infra.settings import Settings, get_settings
from common.infra.storage import make_store
from common.infra.warm_up import warm_up
from common.infra.worker_registry import WorkerRegistry

log = logging.getLogger(__name__)

# Multipart framing and the `purpose` field ride on top of the file itself.
UPLOAD_OVERHEAD_BYTES = 1024 * 1024


class RouteBodyLimits:
    """The upload routes stream files far larger than any JSON body (POST /v1/datasets two of them); every
    other route keeps max_body_bytes."""

    def __init__(self, app: ASGIApp, default_bytes: int, file_bytes: int) -> None:
        self.default = BodySizeLimit(app, max_bytes=default_bytes)
        self.uploads = {
            "/v1/files": BodySizeLimit(app, max_bytes=file_bytes + UPLOAD_OVERHEAD_BYTES),
            "/v1/datasets": BodySizeLimit(app, max_bytes=2 * file_bytes + UPLOAD_OVERHEAD_BYTES),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.default
        if scope["type"] == "http" and scope.get("method") == "POST":
            limit = self.uploads.get(scope.get("path", "").rstrip("/"), self.default)
        await limit(scope, receive, send)


async def _match_no_route(app: FastAPI) -> None:
    """FastAPI builds the routes of each included router on the first request matched against them, on the
    event loop: a path no route takes is matched against all of them, so the first real request finds them
    built. Straight to the router: no middleware counts it."""
    path = "/v1/-/warm-up"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0)}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    await app.router(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The served model's tokenizer is read, and connections made, now, off the event loop, rather than by
        # the first request (common/infra/warm_up.py).
        await run_in_threadpool(served_model, settings.model)
        state: AppState = app.state.vlmq
        await run_in_threadpool(warm_up, [state.db], state.store, state.celery)
        await run_in_threadpool(register_image_plugins)  # jobs' images are checked here
        await _match_no_route(app)
        yield
        await app.state.job_waiter.close()
        app.state.job_writer.close()
        app.state.vlmq.db.dispose()

    app = FastAPI(title="vlmq", version="0.1.0", lifespan=lifespan,
                  description="Batch inference for vision-language models.")
    app.state.vlmq = AppState(
        settings=settings,
        db=get_database(settings.database_url),
        store=make_store(settings),
        celery=make_celery(settings),
    )
    app.state.job_writer = JobWriter(app.state.vlmq)
    app.state.job_waiter = JobWaiter(app.state.vlmq.db)
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    app.state.rate_limiter = RateLimiter(settings.tenant_requests_per_second, settings.broker_url)
    app.state.open_jobs = OpenJobsCounter()
    install_error_handlers(app)
    app.include_router(health.router)
    # Every /v1 route needs a tenant: its API key's, or `default` in embedded mode.
    for router in (images.router, jobs.router, chat.router, models.router, files.router, batches.router,
                   datasets.router):
        app.include_router(router, dependencies=[Depends(get_tenant), Depends(rate_limit)],
                           responses=error_responses(401, 422, 429, 503))
    app.add_middleware(RouteBodyLimits, default_bytes=settings.max_body_bytes, file_bytes=settings.max_file_bytes)
    app.add_middleware(BodyIdleTimeout, seconds=settings.body_idle_timeout_seconds)
    # Observability: the status page (its data needs a key) and Prometheus /metrics (open, like /healthz).
    app.state.process_registry = WorkerRegistry(settings.broker_url)
    app.include_router(status.router)
    if settings.metrics_enabled:
        install_metrics(app, app.state.vlmq, app.state.process_registry)
    return app
