"""FastAPI dependencies: one Settings, database, object store and Celery app per API process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from celery import Celery
from fastapi import Depends, Request
from sqlalchemy.orm import Session

from common.infra.db import Database
from common.infra.settings import Settings
from common.infra.storage import ObjectStore


@dataclass
class AppState:
    settings: Settings
    db: Database
    store: ObjectStore
    celery: Celery


async def get_state(request: Request) -> AppState:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hand-off per request for
    # an attribute read (py-spy: most of POST /v1/jobs' dependency solving).
    state: AppState = request.app.state.vlmq
    return state


def get_session(state: Annotated[AppState, Depends(get_state)]) -> Iterator[Session]:
    with state.db.session() as session:
        yield session


StateDep = Annotated[AppState, Depends(get_state)]
# scope="function": the session commits before the answer is sent (FastAPI's default runs a yield
# dependency's exit after it), so a client acting on the answer at once finds what it was told exists.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


async def get_store(state: StateDep) -> ObjectStore:
    return state.store


async def get_settings_dep(state: StateDep) -> Settings:
    return state.settings


StorageDep = Annotated[ObjectStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
