"""How the CLI talks to a running vlmq API: its URL and the API key, both from options or the environment."""

from __future__ import annotations

import os
from typing import Annotated

import httpx
import typer

ApiUrl = Annotated[str, typer.Option("--api-url", envvar="VLMQ_API_URL",
                                     help="Base URL of a vlmq API (its key: VLMQ_API_KEY).")]


def api_client(api_url: str, timeout: float) -> httpx.Client:
    """An httpx client for the API, sending `Authorization: Bearer $VLMQ_API_KEY` when that is set (an API
    without auth, in embedded mode, ignores it)."""
    key = os.environ.get("VLMQ_API_KEY", "").strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=api_url.rstrip("/"), timeout=timeout, headers=headers)
