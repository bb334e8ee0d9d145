"""How long migration 0004 (image owners recovered from every job's request) takes on a large jobs table.

    python bench/migration_0004.py [--jobs 1000000] [--images 10000] [--tenants 20]

A throwaway Postgres database is upgraded to 0003 and filled, in SQL (generate_series), with --jobs jobs of
--tenants tenants, each naming one of --images images in a request shaped as the API stores it; then the
upgrade to 0004 is timed. Prints the time, jobs/s and the owner rows it wrote (each (tenant, image) pair
that some job names, checked against a count in SQL).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PG_ADMIN = os.environ.get("VLMQ_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")

FILL = """
INSERT INTO images (id, format, width, height, size_bytes, created_at)
SELECT lpad(to_hex(i), 64, '0'), 'PNG', 16, 16, 100, now() FROM generate_series(1, :images) AS i;
INSERT INTO jobs (id, tenant, status, model, priority, request, attempts, max_attempts, created_at)
SELECT 'job_' || i, 't' || ((i / 3) % :tenants), 'succeeded', 'm', 5,
       json_build_object('messages', json_build_array(json_build_object('role', 'user', 'content', json_build_array(
           json_build_object('type', 'image', 'image_id', lpad(to_hex(1 + (i * 7919) % :images), 64, '0')),
           json_build_object('type', 'text', 'text', 'What is in this picture?')))),
           'sampling', json_build_object('max_tokens', 16)),
       1, 3, now()
FROM generate_series(CAST(1 AS bigint), :jobs) AS i;
"""


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=20)
    args = parser.parse_args()

    import psycopg
    from sqlalchemy import text

    from common.infra.db import make_engine
    from common.infra.migrate import upgrade

    name = f"vlmq_bench_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url, "0003")
        engine = make_engine(url)
        params = {"jobs": args.jobs, "images": args.images, "tenants": args.tenants}
        with engine.begin() as conn:
            for statement in filter(str.strip, FILL.split(";")):
                conn.execute(text(statement), params)
            conn.execute(text("ANALYZE"))
            expected = conn.scalar(text(
                "SELECT count(*) FROM (SELECT DISTINCT tenant, request -> 'messages' -> 0 -> 'content' -> 0 "
                "->> 'image_id' FROM jobs) AS pairs"))
        started = time.perf_counter()
        upgrade(url, "0004")
        seconds = time.perf_counter() - started
        with engine.connect() as conn:
            owners = conn.scalar(text("SELECT count(*) FROM image_owners"))
        engine.dispose()
        print(f"CPU: {cpu_name()}")
        print(f"jobs {args.jobs:,}, images {args.images:,}, tenants {args.tenants}: upgrade 0003 -> 0004 took "
              f"{seconds:.1f} s ({args.jobs / seconds:,.0f} jobs/s); {owners:,} owner rows (expected {expected:,})")
        if owners != expected:
            raise SystemExit("owner rows differ from the (tenant, image) pairs the jobs name")
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
