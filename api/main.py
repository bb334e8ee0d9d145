"""The vlmq HTTP API. It never imports torch or worker code; it writes rows and objects and sends tasks."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.deps import AppState
from api.errors import BodySizeLimit, install_error_handlers
from api.routes import health, images, jobs
from common.db import get_database
from common.queue import make_celery
from common.settings import Settings, get_settings
from common.storage import make_store

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.vlmq.db.dispose()

    app = FastAPI(title="vlmq", version="0.1.0", lifespan=lifespan,
                  description="Batch inference for vision-language models.")
    app.state.vlmq = AppState(
        settings=settings,
        db=get_database(settings.database_url),
        store=make_store(settings),
        celery=make_celery(settings),
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(images.router)
    app.include_router(jobs.router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app
