"""A request body that stops arriving is cut off; one whose client goes away is let go quietly.

uvicorn times out idle connections between requests, never a body in progress: a client that sent its headers
and then nothing held a request (and, for an upload, an open object-storage write) for as long as it kept the
connection. Every route reads its body through ASGI `receive`, so one wrapper covers them all (JSON bodies,
streamed multipart uploads, forms): waiting longer than the timeout for the next piece is a 408.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import CLOSE_CONNECTION, TrackedSend

log = logging.getLogger(__name__)


class BodyStalled(HTTPException):
    # An HTTPException, so FastAPI's body parsing re-raises it as is instead of turning it into a 400, and the
    # app's handler answers it.
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body stalled: no data for {seconds:g} seconds", headers=CLOSE_CONNECTION)


class BodyIdleTimeout:
    """408 when `seconds` pass without a piece of the request body; a client that disconnects before its body
    ended gets no answer and leaves one INFO line, not a traceback."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_ended = False
        tracked = TrackedSend(send)
        host, port = scope.get("client") or ("?", "?")
        client = f"{host}:{port}"

        async def timed_receive() -> Message:
            nonlocal body_ended
            if body_ended:  # past the body, `receive` waits for a disconnect: that may take any time
                return await receive()
            try:
                async with asyncio.timeout(self.seconds):
                    message = await receive()
            except TimeoutError:
                log.warning("cut off %s %s from %s: its body stalled for %gs", scope.get("method"),
                            scope.get("path"), client, self.seconds)
                raise BodyStalled(self.seconds) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_ended = True
            return message

        try:
            await self.app(scope, timed_receive, tracked)
        except ClientDisconnect:
            log.info("%s %s: client %s disconnected before its request body ended", scope.get("method"),
                     scope.get("path"), client)
        except BodyStalled as exc:  # raised where no exception handler answers it
            if not tracked.started:
                await JSONResponse({"error": {"message": exc.detail, "type": "invalid_request_error",
                                              "code": "request_timeout", "param": None}},
                                   status_code=408, headers=CLOSE_CONNECTION)(scope, _disconnected, send)


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}
