"""Batch finalization: the time from the last job's end to the batch's output file, with the real parts.

    python bench/finalize.py [--jobs 5000] [--repeats 3] [--code DIR ...]

A batch of --jobs succeeded jobs is written to a fresh Postgres database (bulk: rows, claims and finishes as a
worker leaves them), each with its result object in an S3 bucket of moto's standalone server (over HTTP, as
in the tests), then `worker.batches.finalize.finalize_batch` runs in a child process and writes the output JSONL.
Prints its wall time, its CPU, and the S3 server's CPU meanwhile. `--code DIR` (repeatable) runs the same
finalization with other copies of api/, common/, worker/ (for example the code before a change) side by side
in this run; figures are medians of --repeats, the copies alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from service_stack import tree_cpu_seconds  # noqa: E402

from tests.fault_stack import PostgresCluster, free_port, port_open, wait_for  # noqa: E402

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe"}]}],
           "sampling": {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}}

# Run in a child with the code under test first on sys.path: finalize one batch, print JSON.
_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from common.infra.db import get_database
from common.infra.settings import Settings
from common.infra.storage import make_store
from worker.batches.finalize import finalize_batch
settings = Settings(**json.loads(sys.argv[2]))
db, store = get_database(settings.database_url), make_store(settings)
wall, cpu = time.perf_counter(), time.process_time()
status = finalize_batch(sys.argv[3], db, store)
print(json.dumps({"status": status, "seconds": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
"""


def make_batch(settings_fields: dict[str, Any], n_jobs: int) -> str:
    """A batch whose n_jobs jobs have all succeeded, result objects stored, not yet finalized."""
    from common.domain import batches, jobs
    from common.domain.views import chat_completion
    from common.infra.db import get_database
    from common.infra.settings import Settings
    from common.infra.storage import make_store, result_key

    settings = Settings(**settings_fields)
    db, store = get_database(settings.database_url), make_store(settings)
    with db.session() as session:
        batch = batches.create_batch(session, input_file_id="file-bench", endpoint="/v1/chat/completions",
                                     completion_window="24h", model="m", metadata=None)
        batch_id = batch.id
        created = [jobs.new_job(model="m", request=REQUEST, batch_id=batch_id, custom_id=f"row-{i}")
                   for i in range(n_jobs)]
        session.add_all(created)
        session.flush()
        ids = [job.id for job in created]
        stamps = {job.id: int(job.created_at.timestamp()) for job in created}
        tenant = created[0].tenant
        batches.start(session, batch_id)
    texts = {job_id: f"A picture of {i % 97} shapes, mostly round, on a plain background." for i, job_id in
             enumerate(ids)}

    def put(job_id: str) -> None:
        body = chat_completion(job_id, "m", stamps[job_id], texts[job_id], "stop", 40, 16)
        store.put(result_key(job_id, tenant), json.dumps(body).encode(), content_type="application/json")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, ids))
    for start in range(0, n_jobs, 1000):
        part = ids[start:start + 1000]
        with db.session() as session:
            jobs.claim_many(session, part, "bench-worker", 3600)
            jobs.finish_many(session, "bench-worker", {
                job_id: jobs.JobResult(result_key(job_id, tenant), texts[job_id], "stop", 40, 16) for job_id in part})
    db.dispose()
    return batch_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--code", type=Path, action="append", default=[], help="another copy of the code")
    args = parser.parse_args()
    trees = [ROOT, *[path.resolve() for path in args.code]]
    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    postgres = PostgresCluster()
    runs: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    try:
        wait_for(lambda: port_open(port), 30, "the S3 server")
        postgres.init()
        postgres.start()
        from common.infra.migrate import upgrade

        upgrade(postgres.url)
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.repeats):
                for tree in trees:
                    fields = {"database_url": postgres.url, "storage_backend": "s3", "data_dir": tmp,
                              "s3_endpoint_url": f"http://127.0.0.1:{port}", "s3_bucket": f"fin-{uuid.uuid4().hex[:8]}",
                              "s3_access_key_id": "testing", "s3_secret_access_key": "testing"}
                    batch_id = make_batch(fields, args.jobs)
                    s3_before = tree_cpu_seconds(moto.pid)
                    out = subprocess.run([sys.executable, "-c", _CHILD, str(tree), json.dumps(fields), batch_id],
                                         capture_output=True, text=True, cwd=tree, check=True)
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    assert result["status"] == "completed", result
                    result["s3_cpu"] = tree_cpu_seconds(moto.pid) - s3_before
                    runs[tree].append(result)
                    print(f"  repeat {rep + 1}, {tree}: {result['seconds']:.2f} s, {result['cpu']:.2f} s CPU, "
                          f"S3 server {result['s3_cpu']:.2f} s CPU")
    finally:
        moto.terminate()
        postgres.remove()
    print(f"\nfinalize_batch of {args.jobs} succeeded jobs (medians of {args.repeats}):")
    print(f"{'code':<40}{'seconds':>9}{'jobs/s':>10}{'CPU s':>8}{'S3 CPU s':>10}")
    base = statistics.median(r["seconds"] for r in runs[ROOT])
    for tree, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        print(f"{tree!s:<40}{seconds:>9.2f}{args.jobs / seconds:>10.0f}"
              f"{statistics.median(r['cpu'] for r in results):>8.2f}"
              f"{statistics.median(r['s3_cpu'] for r in results):>10.2f}   {seconds / base:.2f}x this tree's time")


if __name__ == "__main__":
    main()
