"""`vlmq healthcheck`: the probe the container images run (no curl in them, and no torch needed).

An HTTP service is healthy when a URL answers 2xx (the API's /readyz). A worker, ingest worker or beat is
healthy when it published its record (common/infra/worker_registry.py) from this host within the last few stats
intervals: the process runs, its threads are not wedged and it reaches the broker.
"""

from __future__ import annotations

import socket
from typing import Annotated

import typer


def healthcheck(
    url: Annotated[str | None, typer.Option(help="Healthy when this URL answers 2xx.")] = None,
    role: Annotated[str | None, typer.Option(help="worker, ingest or beat: healthy when one on this host "
                                                  "published its record lately.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for an answer.")] = 5.0,
) -> None:
    """Exit 0 when healthy, 1 with the reason otherwise."""
    if (url is None) == (role is None):
        raise typer.BadParameter("give exactly one of --url and --role")
    if url is not None:
        import httpx

        try:
            response = httpx.get(url, timeout=timeout)
        except httpx.HTTPError as exc:
            typer.echo(f"unhealthy: {url}: {type(exc).__name__}: {exc}", err=True)
            raise typer.Exit(1) from exc
        if not response.is_success:
            typer.echo(f"unhealthy: {url} answered {response.status_code}: {response.text[:300]}", err=True)
            raise typer.Exit(1)
        return
    from common.infra.settings import Settings
    from common.infra.worker_registry import WorkerRegistry

    registry = WorkerRegistry(Settings().broker_url)
    try:
        records = registry.list()
    except Exception as exc:
        typer.echo(f"unhealthy: cannot read the registry: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        registry.close()
    host = socket.gethostname()
    if not any(r.get("role") == role and r.get("host") == host for r in records):
        typer.echo(f"unhealthy: no {role} on {host} published its record lately", err=True)
        raise typer.Exit(1)
