"""How the CLI talks to a running vlmq API: its URL and the API key, both from options or the environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import httpx

ApiUrl = Annotated[str, typer.Option("--api-url", envvar="VLMQ_API_URL",
                                     help="Base URL of a vlmq API (its key: VLMQ_API_KEY).")]


@contextmanager
def api_client(api_url: str, timeout: float) -> Iterator[httpx.Client]:
    """An httpx client for the API, sending `Authorization: Bearer $VLMQ_API_KEY` when that is set (an API
    without auth, in embedded mode, ignores it). An API that cannot be reached ends the command with a line
    that says so, not a traceback."""
    import httpx  # here: every other command (vlmq run, the workers) starts without it

    key = os.environ.get("VLMQ_API_KEY", "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=api_url.rstrip("/"), timeout=timeout, headers=headers) as client:
        try:
            yield client
        except httpx.TransportError as exc:
            typer.echo(f"error: cannot reach the vlmq API at {api_url} ({type(exc).__name__}: {exc}); is it "
                       "running? (--api-url or VLMQ_API_URL)", err=True)
            raise typer.Exit(1) from None
