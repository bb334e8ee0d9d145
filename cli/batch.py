"""`vlmq batch ...`: submit a batch file (and its images) to a running API, follow it, fetch its results.

Only httpx and the standard library: this runs on a laptop against a remote vlmq. Files are streamed, never
read whole, and a folder of images is zipped to a temporary file first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.api_client import ApiUrl, api_client
from common.images.archive import images_archive

if TYPE_CHECKING:
    import httpx  # the client comes from cli.api_client, which imports it when a command runs

batch_app = typer.Typer(help="OpenAI-style batches on a running vlmq API.", no_args_is_help=True)

FINAL = ("completed", "failed", "cancelled", "expired")


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        typer.echo(f"error {response.status_code}: {message}", err=True)
        raise typer.Exit(1)
    return response.json()


def _upload(client: httpx.Client, path: Path) -> str:
    with path.open("rb") as f:  # httpx streams a file object in pieces
        file_id: str = _check(client.post("/v1/files", data={"purpose": "batch"}, files={"file": (path.name, f)}))["id"]
        return file_id


def _follow(client: httpx.Client, batch: dict[str, Any], timeout: float) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), TimeRemainingColumn())
    deadline = time.monotonic() + timeout
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:  # stdout: the JSON
        task = progress.add_task(batch["id"], total=None, status=batch["status"], detail="")
        while True:
            counts = batch["request_counts"]
            progress.update(task, total=counts["total"] or None, completed=counts["completed"] + counts["failed"],
                            status=batch["status"], detail=f"{counts['failed']} failed")
            if batch["status"] in FINAL or time.monotonic() > deadline:
                return batch
            time.sleep(1.0)
            batch = _check(client.get(f"/v1/batches/{batch['id']}"))


@batch_app.command("submit")
def submit(
    input_path: Annotated[Path, typer.Argument(help="OpenAI batch JSONL, or a CSV manifest.", exists=True,
                                               dir_okay=False)],
    images: Annotated[Path | None, typer.Option(help="Folder, zip or tar of the images the file names by path.",
                                                exists=True)] = None,
    wait: Annotated[bool, typer.Option(help="Follow the batch with a progress bar until it ends.")] = False,
    metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE to attach (repeatable).")] = None,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    timeout: Annotated[float, typer.Option(help="Seconds to wait with --wait.")] = 86400.0,
) -> None:
    """Upload a batch file (and its images) and create the batch; prints the batch (or follows it)."""
    if bad := [item for item in metadata or [] if "=" not in item or not item.split("=", 1)[0]]:
        raise typer.BadParameter(f"{bad[0]!r} is not KEY=VALUE", param_hint="--metadata")
    pairs = dict(item.split("=", 1) for item in metadata or [])
    with api_client(api_url, 300) as client:
        body: dict[str, Any] = {"endpoint": "/v1/chat/completions", "completion_window": "24h",
                                "metadata": pairs or None}
        if images is not None:
            with images_archive(images) as archive:
                body["images_file_id"] = _upload(client, archive)
        body["input_file_id"] = _upload(client, input_path)
        batch = _check(client.post("/v1/batches", json=body))
        if not wait:
            typer.echo(json.dumps(batch, indent=2))
            return
        typer.echo(f"batch {batch['id']}", err=True)
        batch = _follow(client, batch, timeout)
    typer.echo(json.dumps(batch, indent=2))
    if batch["status"] != "completed":
        raise typer.Exit(1)


@batch_app.command("status")
def status(batch_id: Annotated[str, typer.Argument(help="Batch id.")], api_url: ApiUrl = "http://127.0.0.1:8000"
           ) -> None:
    """Show a batch (status, request counts, files)."""
    with api_client(api_url, 60) as client:
        typer.echo(json.dumps(_check(client.get(f"/v1/batches/{batch_id}")), indent=2))


@batch_app.command("results")
def results(
    batch_id: Annotated[str, typer.Argument(help="Batch id.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the results (JSONL).")],
    api_url: ApiUrl = "http://127.0.0.1:8000",
) -> None:
    """Write a finished batch's output lines, then its error lines, to one JSONL file (in no set order, as
    OpenAI's files: match lines by custom_id)."""
    with api_client(api_url, 300) as client:
        batch = _check(client.get(f"/v1/batches/{batch_id}"))
        if batch["status"] not in FINAL:
            typer.echo(f"batch {batch_id} is {batch['status']}; results exist once it has ended", err=True)
            raise typer.Exit(1)
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_suffix(output.suffix + ".partial")
        with partial.open("wb") as out:
            for file_id in (batch["output_file_id"], batch["error_file_id"]):
                if file_id is None:
                    continue
                with client.stream("GET", f"/v1/files/{file_id}/content") as response:
                    if response.status_code >= 400:
                        response.read()
                        _check(response)
                    for piece in response.iter_bytes():
                        out.write(piece)
        partial.replace(output)
    counts = batch["request_counts"]
    typer.echo(f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed -> {output}", err=True)
    if batch["status"] == "failed":
        for error in ((batch.get("errors") or {}).get("data") or [])[:5]:
            typer.echo(f"  {error.get('code')}: {error.get('message')}", err=True)
        raise typer.Exit(1)
