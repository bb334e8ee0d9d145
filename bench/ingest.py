"""Batch ingestion and single-job submission throughput, with the real parts (Postgres or SQLite, Redis).

    python bench/ingest.py ingest [--rows 100000] [--images 1000] [--db postgres,sqlite] [--repeats 3]
    python bench/ingest.py api [--workers 2] [--seconds 10] [--connections 64] [--repeats 3]

`ingest`: an OpenAI batch JSONL of N rows, each with one text part and one data: URL PNG drawn from a pool of
distinct images (each reused rows/images times), is stored in a local object folder; a batch row is created
and `worker.batches.ingest.ingest_batch` runs in a fresh child process (so its peak RSS, VmHWM, is the ingestion's
alone) with a real Celery app dispatching to a throwaway Redis db number. Prints rows/s, peak RSS, the image
rows written (must equal the distinct images), the objects holding them (one per image, or packs), and the
messages that reached Redis.

`api`: the real app (`api.main:create_app`) in --workers uvicorn processes (one port each), Postgres, Redis broker,
local object folder, auth on (one API key), no worker consuming. A raw keep-alive HTTP/1.1 client (bench/
_load.py, a few client processes) posts POST /v1/jobs as fast as the server answers, for text-only jobs and
for jobs naming an already-uploaded image id. Every answer must be a 202.

`--code DIR` (repeatable) runs the same measurement against other copies of api/, cli/, common/, worker/ (for
example the code before an optimisation) side by side in this run; figures are medians of --repeats.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("VLMQ_BENCH_CODE"):  # a child measuring another copy of the code: that copy comes first
    sys.path.insert(0, os.environ["VLMQ_BENCH_CODE"])

PG_ADMIN = os.environ.get("VLMQ_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("VLMQ_BENCH_REDIS", "redis://127.0.0.1:6379")
MODEL = "bench-model"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return "unknown"


def png(rng: random.Random, px: int) -> bytes:
    from PIL import Image

    im = Image.frombytes("RGB", (px, px), rng.randbytes(px * px * 3))
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path: Path, rows: int, images: int, px: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    urls = ["data:image/png;base64," + base64.b64encode(png(rng, px)).decode() for _ in range(images)]
    with path.open("w") as f:
        for i in range(rows):
            body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": [
                {"type": "text", "text": f"describe picture {i} in one word"},
                {"type": "image_url", "image_url": {"url": urls[i % images]}}]}]}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return path.stat().st_size


class Environment:
    """A fresh Postgres database (or SQLite file), a Redis db number and an object folder; removed at exit."""

    def __init__(self, kind: str, tmp: Path) -> None:
        import redis

        self.kind, self.tmp = kind, tmp
        # An empty db number (test sessions take random ones and flush them; an empty one is likely free).
        candidates = random.sample(range(1, 16), 15)
        self.redis_db = next((n for n in candidates if not redis.Redis.from_url(f"{REDIS_BASE}/{n}").dbsize()),
                             candidates[0])
        self.redis_url = f"{REDIS_BASE}/{self.redis_db}"
        redis.Redis.from_url(self.redis_url).flushdb()
        self.pg_name = None
        if kind == "postgres":
            import psycopg

            self.pg_name = f"vlmq_bench_{uuid.uuid4().hex[:10]}"
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{self.pg_name}"')
            self.db_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{self.pg_name}"
        else:
            self.db_url = f"sqlite:///{tmp / f'bench-{uuid.uuid4().hex[:6]}.db'}"
        from common.infra.migrate import upgrade

        upgrade(self.db_url)
        # The model's config and tokenizer are readable, as where the API shares the worker's HF cache: every
        # request is measured against its context at submission (the demo model's files, named MODEL).
        model_dir = tmp / MODEL
        model_dir.mkdir(exist_ok=True)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (model_dir / name).write_bytes((ROOT / "worker" / "demo" / "model" / name).read_bytes())
        self.env = {"VLMQ_DATABASE_URL": self.db_url, "VLMQ_BROKER_URL": self.redis_url,
                    "VLMQ_DATA_DIR": str(tmp / "data"), "VLMQ_STORAGE_DIR": str(tmp / f"objects-{self.redis_db}"),
                    "VLMQ_MODEL": str(model_dir), "VLMQ_AUTH": "on"}

    def settings(self) -> Any:
        from common.infra.settings import Settings

        values: dict[str, Any] = {k.removeprefix("VLMQ_").lower(): v for k, v in self.env.items()}
        return Settings(**values)

    def redis_messages(self) -> int:
        import redis

        client = redis.Redis.from_url(self.redis_url)
        return sum(int(client.llen(k)) for k in client.scan_iter() if client.type(k) == b"list")

    def close(self) -> None:
        import redis

        from common.infra.db import _databases

        for db in list(_databases.values()):
            db.dispose()
        _databases.clear()
        redis.Redis.from_url(self.redis_url).flushdb()
        if self.pg_name:
            import psycopg

            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.pg_name}" WITH (FORCE)')


def child_env(code: Path, extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra, "PYTHONPATH": f"{code}:{ROOT}", "VLMQ_BENCH_CODE": str(code),
            "OMP_WAIT_POLICY": "PASSIVE"}


# ---------------------------------------------------------------- ingest


def ingest_once(env: Environment, jsonl: Path, code: Path, chunk_rows: int | None, profile: str | None = None
                ) -> dict[str, Any]:
    from sqlalchemy import func, select

    from common.domain import batches
    from common.domain.files import add_file, file_key
    from common.domain.models import ImageRecord, Job, new_file_id
    from common.infra.db import get_database

    settings = env.settings()
    db = get_database(settings.database_url)
    file_id = new_file_id()
    objects = Path(settings.storage_dir)
    key = file_key(file_id, "bench")
    (objects / key).parent.mkdir(parents=True, exist_ok=True)
    os.link(jsonl, objects / key) if not (objects / key).exists() else None
    with db.session() as session:
        add_file(session, file_id=file_id, key=key, size=jsonl.stat().st_size, filename="in.jsonl", purpose="batch",
                 tenant="bench")
        batch_id = batches.create_batch(session, input_file_id=file_id, endpoint="/v1/chat/completions",
                                        completion_window="24h", model=MODEL, metadata=None, tenant="bench").id
    extra = dict(env.env)
    if chunk_rows:
        extra["VLMQ_INGEST_CHUNK_ROWS"] = str(chunk_rows)
    if profile:
        extra["VLMQ_BENCH_PROFILE"] = profile
    out = subprocess.run([sys.executable, str(Path(__file__)), "_ingest_child", batch_id],
                         env=child_env(code, extra), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ingest child failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    with db.session() as session:
        result["jobs"] = session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id))
        result["image_rows"] = session.scalar(select(func.count()).select_from(ImageRecord))
    # New images go into packs unless VLMQ_IMAGE_PACK_BYTES=0: either folder may be missing.
    result["image_objects"], result["packs"] = ((sum(1 for _ in (objects / d).iterdir()) if (objects / d).is_dir()
                                                 else 0) for d in ("images", "packs"))
    result["redis_messages"] = env.redis_messages()
    return result


def ingest_child(batch_id: str) -> None:
    """Runs in its own process: ingest one batch with real Celery dispatch, report time and peak RSS."""
    from common.broker.queue import make_celery, send_run_jobs
    from common.infra.db import get_database
    from common.infra.settings import Settings
    from common.infra.storage import make_store
    from worker.batches.ingest import IngestDeps, ingest_batch

    settings = Settings()
    app = make_celery(settings)
    deps = IngestDeps(settings, get_database(settings.database_url), make_store(settings),
                      lambda s, ids, p: send_run_jobs(app, s, ids, p))
    rss_before = _vm("VmRSS")
    profile = os.environ.get("VLMQ_BENCH_PROFILE")
    start = time.perf_counter()
    if profile:
        import cProfile

        with cProfile.Profile() as prof:
            status = ingest_batch(batch_id, deps)
        prof.dump_stats(profile)
    else:
        status = ingest_batch(batch_id, deps)
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"status": status, "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                      "peak_rss_mb": _vm("VmHWM") / 1024, "rss_before_mb": rss_before / 1024,
                      "chunk_rows": settings.ingest_chunk_rows}))


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # kB
    return 0


def run_ingest(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="vlmq-bench-"))
    jsonl = tmp / "input.jsonl"
    size = write_jsonl(jsonl, args.rows, args.images, args.image_px)
    print(f"input: {args.rows} rows, {args.images} distinct {args.image_px}x{args.image_px} PNGs, "
          f"{size / 1e6:.1f} MB; chunk rows: {args.chunk_rows or 'default'}; repeats: {args.repeats}")
    for kind in args.db.split(","):
        for code in args.code:
            runs = []
            for _ in range(args.repeats):
                env = Environment(kind, tmp)  # fresh database each time: images are new to it, as in production
                try:
                    runs.append(ingest_once(env, jsonl, code, args.chunk_rows, args.profile))
                finally:
                    env.close()
            r = runs[-1]
            rates = [args.rows / x["seconds"] for x in runs]
            cpu = [x["cpu_seconds"] / args.rows * 1e6 for x in runs]  # process CPU incl. start-up: less noisy
            print(f"{kind:8s} code={code}: {statistics.median(rates):,.0f} rows/s (runs: "
                  f"{', '.join(f'{x:,.0f}' for x in rates)}), peak RSS {max(x['peak_rss_mb'] for x in runs):.0f} MB "
                  f"(at start {r['rss_before_mb']:.0f} MB), ingester CPU {statistics.median(cpu):.0f} us/row, "
                  f"status {r['status']}, jobs {r['jobs']}, image rows {r['image_rows']}, image objects "
                  f"{r['image_objects']}, packs {r['packs']}, messages in Redis {r['redis_messages']}, "
                  f"chunk {r['chunk_rows']}", flush=True)


# ---------------------------------------------------------------- api


def run_api(args: argparse.Namespace) -> None:
    from bench._load import load

    tmp = Path(tempfile.mkdtemp(prefix="vlmq-bench-api-"))
    print(f"API processes: {args.workers} (one uvicorn each, own port; the client spreads its connections over "
          f"them, as a load balancer would: uvicorn --workers left one process with most keep-alive connections "
          f"here), --http {args.http}, --loop {args.loop}; client: {args.clients} process(es) x "
          f"{args.connections} keep-alive connections; {args.seconds}s per measurement; repeats: {args.repeats}")
    for code in args.code:
        env = Environment("postgres", tmp)
        servers: list[subprocess.Popen[bytes]] = []
        try:
            key, image_id = _prepare_api(env)
            ports = [_free_port() for _ in range(args.workers)]
            servers = [subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--port", str(port),
                 "--log-level", "warning", "--no-access-log", "--http", args.http, "--loop", args.loop],
                env=child_env(code, env.env), cwd=str(code)) for port in ports]
            for port in ports:
                _wait_ready(port)
            text = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hello there"}]}
            with_image = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": image_id}}]}]}
            for name, body in (("text", text), ("image id", with_image)):
                load(ports, key, body, 1.0, args.connections, args.clients)  # warm up
                if args.profile:  # py-spy samples the servers while they hold the GIL, during one extra run
                    spies = [subprocess.Popen(
                        ["py-spy", "record", "--format", "raw", "--gil", "-r", "200", "-o",
                         f"{args.profile}.{name.replace(' ', '_')}.{i}.txt", "-p", str(server.pid),
                         "-d", str(int(args.seconds))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for i, server in enumerate(servers)]
                    load(ports, key, body, args.seconds, args.connections, args.clients)
                    for spy in spies:
                        spy.wait()
                rates, cpu = [], []
                for _ in range(args.repeats):
                    before = sum(_cpu_seconds(server.pid) for server in servers)
                    rates.append(load(ports, key, body, args.seconds, args.connections, args.clients))
                    used = sum(_cpu_seconds(server.pid) for server in servers) - before
                    cpu.append(used / (rates[-1] * args.seconds) * 1e6)
                print(f"api code={code} {name:8s}: {statistics.median(rates):,.0f} jobs/s (runs: "
                      f"{', '.join(f'{x:,.0f}' for x in rates)}), API CPU {statistics.median(cpu):,.0f} us/job; "
                      f"messages in Redis {env.redis_messages()}", flush=True)
        finally:
            for server in servers:
                server.terminate()
                server.wait(30)
            env.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _prepare_api(env: Environment) -> tuple[str, str]:
    from common.domain.apikeys import create_key
    from common.images.stored import image_public_id, store_image
    from common.infra.db import get_database
    from common.infra.storage import make_store

    settings = env.settings()
    db = get_database(settings.database_url)
    with db.session() as session:
        key = create_key(session, "bench").key
        image = store_image(session, make_store(settings), png(random.Random(1), 16), settings, "bench")
        return key, image_public_id(image.id)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int) -> None:
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                time.sleep(1.0)  # let every uvicorn worker finish starting
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("uvicorn did not start")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_ingest_child":
        ingest_child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    ingest = sub.add_parser("ingest")
    ingest.add_argument("--rows", type=int, default=100_000)
    ingest.add_argument("--images", type=int, default=1000)
    ingest.add_argument("--image-px", type=int, default=16)
    ingest.add_argument("--db", default="postgres,sqlite")
    ingest.add_argument("--chunk-rows", type=int, default=None, help="VLMQ_INGEST_CHUNK_ROWS (default: settings')")
    ingest.add_argument("--profile", default=None, help="write a cProfile of the ingesting child here")
    api = sub.add_parser("api")
    api.add_argument("--workers", type=int, default=2)
    api.add_argument("--seconds", type=float, default=10.0)
    api.add_argument("--connections", type=int, default=64)
    api.add_argument("--clients", type=int, default=1, help="client processes")
    api.add_argument("--http", default="auto", help="uvicorn --http: auto (httptools if installed), h11, httptools")
    api.add_argument("--loop", default="auto", help="uvicorn --loop: auto (uvloop if installed), asyncio, uvloop")
    api.add_argument("--profile", default=None, help="py-spy the server into PROFILE.<jobs kind>.txt (collapsed)")
    for p in (ingest, api):
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--code", type=Path, action="append", default=None,
                       help="root holding api/, common/, worker/ to measure (default: this checkout)")
    args = parser.parse_args()
    args.code = [c.resolve() for c in (args.code or [ROOT])]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cpus); python {sys.version.split()[0]}")
    run_ingest(args) if args.what == "ingest" else run_api(args)


if __name__ == "__main__":
    main()
