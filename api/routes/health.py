"""Liveness and readiness: ready means SQL, the broker and object storage all answer."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _check_sql(state: Any) -> None:
    with state.db.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def _check_broker(state: Any) -> None:
    with state.celery.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)


def _check_storage(state: Any) -> None:
    state.store.check()


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    checks = {"sql": _check_sql, "broker": _check_broker, "storage": _check_storage}
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            await asyncio.wait_for(asyncio.to_thread(check, state), timeout=5)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    ready = all(v == "ok" for v in results.values())
    return JSONResponse({"status": "ready" if ready else "unavailable", "checks": results},
                        status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "5"})
