"""The `vlmq` command. Heavy imports (torch, the worker) happen inside the commands that need them."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

# Before anything imports torch: OpenMP's threads otherwise spin between parallel regions, taking the cores
# from the Python threads that feed the engine (`vlmq run`'s engine in its own process; a worker's job threads
# beside its engine process). A setting of the user's own is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from cli.api_client import ApiUrl, api_client
from common.infra.logs import celery_flags, route_library_logs, setup_process_logging, uvicorn_log_config
from common.infra.worker_registry import start_heartbeat

if TYPE_CHECKING:
    from celery import Celery

    from common.infra.settings import Settings

app = typer.Typer(help="vlmq: batch inference for vision-language models.", no_args_is_help=True,
                  pretty_exceptions_enable=False)



def _settings(**overrides: Any) -> Settings:
    """Settings from the environment, with the command-line options given on top."""
    from common.infra.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _require_object_store(settings: Settings) -> None:
    """Exit with one line when the object store cannot be used (common/infra/storage_check.py)."""
    from common.infra.storage_check import object_store_problem

    if (problem := object_store_problem(settings)) is not None:
        typer.echo(f"error: object storage: {problem}", err=True)
        raise typer.Exit(1)


def _started(settings: Settings) -> None:
    """The process has built what it keeps for its life: freeze it out of the garbage collector's scans."""
    if settings.gc_freeze:
        from common.infra.heap import freeze_startup_heap

        freeze_startup_heap()


def _run_celery(celery_app: Celery, argv: list[str]) -> None:
    """Run a Celery command; a worker exits with the status it stopped with. Celery drops that status when
    run from Python (`app.start` runs its click command in non-standalone mode and returns nothing), so a
    worker that stopped on an "Unrecoverable error" (status 1) exited 0, and a supervisor that restarts only
    failed processes left it down. The worker is caught as it is made (the `worker_init` signal) to read it."""
    from celery.signals import worker_init

    workers: list[Any] = []

    def keep(sender: Any, **_: Any) -> None:
        workers.append(sender)

    worker_init.connect(keep)
    try:
        celery_app.start(argv)
    finally:
        worker_init.disconnect(keep)
    status = workers[-1].exitcode if workers else None
    if status:
        raise typer.Exit(status if isinstance(status, int) else 1)


@app.command()
def migrate() -> None:
    """Upgrade the database to the latest schema."""
    from common.infra.migrate import upgrade

    settings = _settings()
    upgrade(settings.database_url)
    typer.echo("database is at the latest revision")


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    model: Annotated[str | None, typer.Option(help="Model served by the embedded worker.")] = None,
) -> None:
    """Serve the REST API. With the in-process broker (memory://) a worker runs inside this process too."""
    import uvicorn

    from api.main import create_app
    from common.infra.migrate import upgrade

    settings = _settings(model=model)
    setup_process_logging(settings.log_format)
    _require_object_store(settings)
    if settings.embedded_broker:
        upgrade(settings.database_url)  # embedded: there is no separate migrate step
        from common.broker.queue import make_celery
        from worker.embedded import embedded_worker, resume_ingestions

        fastapi_app = create_app(settings)
        celery_app = make_celery(settings)
        fastapi_app.state.vlmq.celery = celery_app  # the API and the worker must share the in-memory broker
        with embedded_worker(celery_app, settings):
            if resumed := resume_ingestions(celery_app, settings):
                logging.getLogger("vlmq").warning("resumed the ingestion of %d batches an earlier process left",
                                                  resumed)
            _started(settings)
            uvicorn.run(fastapi_app, host=host, port=port, log_config=uvicorn_log_config(settings.log_format))
        return
    fastapi_app = create_app(settings)
    _started(settings)
    uvicorn.run(fastapi_app, host=host, port=port, log_config=uvicorn_log_config(settings.log_format))


@app.command()
def worker(
    concurrency: Annotated[int | None, typer.Option(help="Jobs held in flight (threads).")] = None,
    model: Annotated[str | None, typer.Option(help="HF model id or path (default: VLMQ_MODEL).")] = None,
    ingest: Annotated[bool, typer.Option("--ingest/--no-ingest",
                                         help="Also run batch ingestion/finalization (the ingest queue).")] = True,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run a GPU/CPU worker: one model per process, many jobs in flight, batched together."""
    from common.broker.queue import ingest_queue, make_celery
    from worker.context import get_context
    from worker.tasks import register_tasks, warm_batch_context

    settings = _settings(model=model, worker_concurrency=concurrency)
    setup_process_logging(settings.log_format, loglevel)
    _require_object_store(settings)
    # Celery sets the root level only once it starts; the engine process, started before, logs at this one.
    logging.getLogger().setLevel(loglevel.upper())
    celery_app = make_celery(settings)
    register_tasks(celery_app)
    context = get_context(settings)  # load the model before taking any message
    if ingest:
        warm_batch_context(celery_app)
    route_library_logs(settings.log_format)
    if settings.metrics_port and context.telemetry is not None:
        context.telemetry.serve(settings.metrics_port)
    queues = [settings.job_queue] + ([ingest_queue(settings)] if ingest else [])
    _started(settings)
    _run_celery(celery_app, [*celery_flags(settings.log_format),
        "worker", "--pool=threads", f"--concurrency={settings.worker_concurrency}", f"--queues={','.join(queues)}",
        f"--loglevel={loglevel}", "--without-gossip", "--without-mingle", f"--hostname=vlmq-{settings.job_queue}@%h",
    ])


@app.command("ingest-worker")
def ingest_worker(
    concurrency: Annotated[int | None, typer.Option(help="Batch tasks run at once (threads).")] = None,
    beat: Annotated[bool, typer.Option(help="Also run Celery beat here (the maintenance sweep).")] = False,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Run batch ingestion, cancellation and finalization (the ingest queue). Loads no model, imports no torch."""
    from common.broker.queue import ingest_queue, make_celery
    from worker.tasks import register_tasks, warm_batch_context

    settings = _settings(ingest_concurrency=concurrency)
    setup_process_logging(settings.log_format, loglevel)
    _require_object_store(settings)
    celery_app = make_celery(settings)
    register_tasks(celery_app)
    for role in ("ingest", "beat") if beat else ("ingest",):  # the status page and healthcheck see it
        start_heartbeat(settings.broker_url, role, settings.stats_interval_seconds)
    argv = [*celery_flags(settings.log_format), "worker", "--pool=threads",
            f"--concurrency={settings.ingest_concurrency}",
            f"--queues={ingest_queue(settings)}", f"--loglevel={loglevel}", "--without-gossip", "--without-mingle",
            "--hostname=vlmq-ingest@%h"]
    if beat:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        argv += ["--beat", f"--schedule={settings.data_dir / 'celerybeat-schedule'}"]
    warm_batch_context(celery_app)
    _started(settings)
    _run_celery(celery_app, argv)


@app.command()
def beat(loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO") -> None:
    """Run Celery beat alone: it sends the maintenance sweep every VLMQ_SWEEP_INTERVAL_SECONDS (reap expired
    leases, resend what the broker lost, top up dispatch windows, expire and finalize batches). Run one."""
    from common.broker.queue import make_celery

    settings = _settings()
    setup_process_logging(settings.log_format, loglevel)
    start_heartbeat(settings.broker_url, "beat", settings.stats_interval_seconds)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _run_celery(make_celery(settings), [*celery_flags(settings.log_format), "beat", f"--loglevel={loglevel}",
                                        f"--schedule={settings.data_dir / 'celerybeat-schedule'}"])


@app.command()
def run(
    input_path: Annotated[Path, typer.Argument(help="OpenAI batch input JSONL, or a CSV manifest.", exists=True,
                                               dir_okay=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the OpenAI batch output JSONL.")],
    model: Annotated[str | None, typer.Option(help="HF model id or local path.")] = None,
    images: Annotated[Path | None, typer.Option(help="Folder, zip or tar of the images the file names by path.",
                                                exists=True)] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Embedded state folder (default ~/.vlmq).")] = None,
) -> None:
    """Run every request of a batch file through vlmq on embedded defaults and write the results."""
    from rich.console import Console

    from common.infra.heap import freeze_startup_heap
    from worker.batches.local_run import run_file
    from worker.embedded import DataDirBusy

    global _exit_at_once
    settings = _settings(model=model, data_dir=data_dir)
    if not settings.model:
        raise typer.BadParameter("no model: pass --model PATH_OR_ID or set VLMQ_MODEL", param_hint="--model")
    console = Console(stderr=True)
    _exit_at_once = True
    try:
        # Frozen once the model is loaded: the full collections a run's jobs trigger would otherwise walk every
        # object of torch, transformers and the model, with the GIL held. The run is at work by then (its input
        # stored and queued), so without the collection first, whose pause is the very one to spare the jobs.
        freeze = partial(freeze_startup_heap, collect=False) if settings.gc_freeze else None
        summary = run_file(input_path, output, settings, console, images=images, on_model_loaded=freeze)
    except (ValueError, OSError, ImportError, NotImplementedError, DataDirBusy) as exc:
        # An unwritable output, a data folder in use or not a folder, a model that cannot be loaded or run.
        console.print(f"[bold red]error[/bold red]: {exc}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        console.print(f"[bold]interrupted[/bold]: finished requests are kept in {settings.data_dir}; run the same "
                      "command again to carry on where this run stopped")
        raise typer.Exit(130) from None
    if summary.status == "failed" and not summary.submitted:
        reasons = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in summary.errors[:5]) or "no reason given"
        console.print(f"[bold red]failed[/bold red]: nothing in {input_path} could run ({reasons}); "
                      f"{len(summary.line_errors)} refused lines are in {output}")
        raise typer.Exit(1)
    ok = summary.counts.get("succeeded", 0)
    rate = summary.submitted / summary.elapsed_s if summary.elapsed_s else 0.0
    console.print(
        f"[bold]done[/bold]: {summary.total_lines} lines, {ok} succeeded, "
        f"{summary.submitted - ok} failed in the worker, {len(summary.line_errors)} refused; "
        f"{summary.elapsed_s:.2f}s ({summary.elapsed_s - summary.loading_s:.2f}s once the model was loaded), "
        f"{rate:.2f} jobs/s, "
        f"{summary.completion_tokens / summary.elapsed_s if summary.elapsed_s else 0:.1f} generated tokens/s "
        f"-> {output}"
    )
    if summary.accuracy is not None:
        console.print(f"[bold]accuracy[/bold]: {summary.correct}/{summary.expected} answers match the file's "
                      f"expected answers (metadata.answer): {summary.accuracy:.1%}")


@app.command()
def submit(
    image: Annotated[list[Path], typer.Option("--image", "-i", help="Image file (repeatable).", exists=True)],
    prompt: Annotated[str, typer.Argument(help="The question or instruction.")],
    wait: Annotated[bool, typer.Option(help="Wait for the job and print its answer.")] = False,
    max_tokens: Annotated[int | None, typer.Option(
        help="Tokens to generate at most (default: the model's generation config, else VLMQ_DEFAULT_MAX_TOKENS).",
        min=1)] = None,
    api_url: ApiUrl = "http://127.0.0.1:8000",
    timeout: Annotated[float, typer.Option(help="Seconds to wait with --wait.")] = 600.0,
) -> None:
    """Submit one job (images + prompt) to a running API."""
    files = [("image", (p.name, p.read_bytes())) for p in image]
    with api_client(api_url, 60) as client:
        form = {"prompt": prompt, **({"max_tokens": str(max_tokens)} if max_tokens is not None else {})}
        response = client.post("/v1/jobs", data=form, files=files)
        if response.status_code >= 400:
            typer.echo(f"error {response.status_code}: {response.text}", err=True)
            raise typer.Exit(1)
        job = response.json()
        if not wait:
            typer.echo(json.dumps(job, indent=2))
            return
        deadline = time.monotonic() + timeout
        while job["status"] in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = client.get(f"/v1/jobs/{job['id']}").json()
    if job["status"] != "succeeded":
        typer.echo(f"job {job['id']} is {job['status']}: {job.get('error')}", err=True)
        raise typer.Exit(1)
    typer.echo(job["result"]["text"])


@app.command()
def status(job_id: Annotated[str, typer.Argument(help="Job id.")], api_url: ApiUrl = "http://127.0.0.1:8000") -> None:
    """Show one job."""
    with api_client(api_url, 30) as client:
        response = client.get(f"/v1/jobs/{job_id}")
    typer.echo(json.dumps(response.json(), indent=2))
    if response.status_code >= 400:
        raise typer.Exit(1)


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Build a tiny random-weight LLaVA offline. Its answers are noise: it is for tests and smoke runs."""
    from worker.inference.tiny_model import build_tiny_llava

    path = build_tiny_llava(out_dir, seed=seed)
    typer.echo(f"tiny random-weight LLaVA written to {path} (its answers are noise)")


def _add_batch_commands() -> None:
    from cli.apikey import apikey_app
    from cli.batch import batch_app
    from cli.healthcheck import healthcheck

    app.command("healthcheck")(healthcheck)

    app.add_typer(batch_app, name="batch")
    app.add_typer(apikey_app, name="apikey")


_add_batch_commands()


# Set by a command whose process has nothing left to tear down once it returns (see main).
_exit_at_once = False


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        app()
    except SystemExit as done:
        if not _exit_at_once:
            raise
        # `vlmq run` has written its output and stopped its worker: the interpreter's teardown of torch and
        # the model would only keep the user waiting, and an engine child ends on its own when its pipe closes.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        os._exit(code)


if __name__ == "__main__":
    main()
