"""Every refusal is a 4xx with a message; infrastructure trouble is a 503 with Retry-After, never a 500."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.domain.schemas import ErrorResponse
from common.domain.submission import SubmissionError

log = logging.getLogger(__name__)

_MEANINGS = {
    400: "The request is invalid (see error.code and error.message).",
    401: "Missing or invalid API key.",
    404: "No such resource for this tenant, or no such served model.",
    408: "The request body stopped arriving (no data for body_idle_timeout_seconds).",
    409: "The resource's state does not allow this.",
    413: "The request body, a file or an image is over this server's limit.",
    415: "Unsupported content type.",
    422: "The request failed validation (error.param names the field).",
    429: "The tenant is over its request rate or open-jobs limit; retry after Retry-After seconds.",
    500: "The job ended dead: the server gave up on it after its retries.",
    503: "A backing service (database, task queue) is unavailable, or no model is configured; retry later.",
    504: "The job has not ended within the server's wait limit; it carries on (poll GET /v1/jobs/{id}).",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for these status codes, each with the error body every refusal has."""
    return {code: {"model": ErrorResponse, "description": _MEANINGS[code]} for code in codes}


def error_body(message: str, code: str, type_: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def _location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if p not in ("body", "query", "path", "header", "form"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SubmissionError)
    async def _submission(_: Request, exc: SubmissionError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.code, param=exc.param), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = _location(tuple(err.get("loc", ())))
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        first = exc.errors()[0] if exc.errors() else {}
        return JSONResponse(
            error_body("; ".join(problems) or "invalid request", "invalid_request",
                       param=_location(tuple(first.get("loc", ()))) or None),
            status_code=422,
        )

    # Starlette's class, not FastAPI's subclass: Starlette itself raises it (bad multipart data, unknown
    # routes), and those answers should have the same shape as ours.
    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {401: "invalid_api_key", 403: "forbidden", 429: "rate_limit_exceeded", 404: "not_found",
                405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "request_too_large",
                415: "unsupported_media_type"}.get(exc.status_code, "error")
        return JSONResponse(error_body(str(exc.detail), code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    # A value the database refuses (a NUL byte in an id, say) is the request's fault: retrying cannot help.
    @app.exception_handler(DataError)
    async def _data(_: Request, exc: DataError) -> JSONResponse:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else "invalid value"
        return JSONResponse(error_body(f"the request holds a value the database cannot store: {reason[:200]}",
                                       "invalid_value"), status_code=400)

    @app.exception_handler(IntegrityError)
    async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
        log.info("conflict: %s", exc)
        return JSONResponse(error_body("the request conflicts with a record written at the same moment; retry it",
                                       "conflict"), status_code=409)

    @app.exception_handler(OperationalError)
    @app.exception_handler(DBAPIError)
    async def _database(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        return JSONResponse(error_body("the database is unavailable; retry shortly", "service_unavailable",
                                       "server_error"), status_code=503, headers={"Retry-After": "5"})


# The rest of a refused body is not worth reading: closing the connection stops the server from draining it
# (uvicorn would read and discard it all to keep the connection alive).
CLOSE_CONNECTION = {"Connection": "close"}


class TrackedSend:
    """`send`, remembering whether the response has started: a body middleware may answer an error of its own
    only before the app has."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


class BodySizeLimit:
    """Refuse bodies above `max_bytes` with 413, whether or not the client sent Content-Length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large(send)
                return
        received = 0
        tracked = TrackedSend(send)

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, limited_receive, tracked)
        except _TooLarge:
            if not tracked.started:
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse(
            error_body(f"request body exceeds the limit of {self.max_bytes} bytes", "request_too_large"),
            status_code=413, headers=CLOSE_CONNECTION,
        )
        await response({"type": "http"}, _empty_receive, send)


class _TooLarge(HTTPException):
    # An HTTPException, so FastAPI's body parsing re-raises it as is instead of turning it into a 400.
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_bytes} bytes", headers=CLOSE_CONNECTION)


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}
