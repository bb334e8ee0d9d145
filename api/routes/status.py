"""The status page: /status is a static page (plain HTML + JS, no build step); it fetches /status/data with the
API key it was given (the URL fragment `#key=...`, never sent to the server, or typed into the page).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse

from api.auth import TenantDep
from api.deps import StateDep
from api.limits import rate_limit
from api.status_report import status_report

router = APIRouter(tags=["status"], include_in_schema=False)

_PAGE = files("api").joinpath("static/status.html")


@router.get("/status", response_class=HTMLResponse)
def status_page() -> HTMLResponse:
    # The shell holds no data, so it needs no key; a strict CSP keeps it from loading anything else.
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"), headers={
        "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                   "connect-src 'self'; img-src 'self' data:",
        "Cache-Control": "no-cache"})


@router.get("/status/data", dependencies=[Depends(rate_limit)])
async def status_data(request: Request, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    settings = state.settings
    everyone = not settings.auth_required or tenant in settings.admin_tenants
    report = await run_in_threadpool(status_report, state, request.app.state.process_registry,
                                     None if everyone else tenant)
    return {**report, "scope": "all tenants" if everyone else f"tenant {tenant}"}
