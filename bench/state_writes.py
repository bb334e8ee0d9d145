"""A worker's grouped claims and finishes (worker/jobs/state_writer.py): CPU per job, by group size.

    python bench/state_writes.py [--jobs 480] [--groups 1,2,4,32] [--repeats 3] [--code DIR ...]

Each run writes --jobs queued jobs to a Postgres cluster of its own, then a child process with the code under
test claims them and finishes them, group by group, as the writer thread of its `StateWriter` does (one
transaction per group, holding both UPDATEs, on the database handle that writer uses). Prints the child's CPU
per job (the worker's side) and Postgres' (the server's side). A worker's groups hold 2-3 jobs on average
under bench/compare.py's service runs, more under heavier load. `--code DIR` (repeatable) runs other copies of
api/, common/, worker/ (for example the code before a change) side by side in this run; figures are medians of
--repeats, the copies alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from service_stack import tree_cpu_seconds  # noqa: E402

from tests.fault_stack import PostgresCluster  # noqa: E402

REQUEST = {"messages": [{"role": "user", "content": [{"type": "text", "text": "describe this " * 8}]}],
           "sampling": {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}}

# Run in a child with the code under test first on sys.path: claim and finish the given jobs in groups of
# `size`, print the CPU it took as JSON.
_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from common.domain import jobs
from common.infra.db import get_database
from worker.jobs.state_writer import StateWriter
ids, size = json.loads(sys.argv[3]), int(sys.argv[4])
writer = StateWriter(get_database(sys.argv[2]), "bench-worker", 600)
try:  # the code from before common/infra/group_commit.py: requests with futures of their own
    from worker.jobs.state_writer import _Request
except ImportError:
    from common.infra.group_commit import Pending
    from worker.jobs.state_writer import _Ask
    def write(asks):
        group = [Pending(_Ask(job_id, result)) for job_id, result in asks]
        writer.committer._commit(group)
        return [pending.result() for pending in group]
else:
    def write(asks):
        group = [_Request(job_id, result) for job_id, result in asks]
        writer._write(group)
        return [request.answer.result() for request in group]
def result(job_id):
    return jobs.JobResult(f"results/{job_id}.json", "A picture of three shapes on a plain background.", "stop", 40, 32)
write([(job_id, None) for job_id in ids[:8]])
write([(job_id, result(job_id)) for job_id in ids[:8]])
ids = ids[8:]
cpu = time.process_time()
for start in range(0, len(ids), size):
    group = ids[start:start + size]
    assert all(job is not None for job in write([(job_id, None) for job_id in group]))
    assert all(write([(job_id, result(job_id)) for job_id in group]))
cpu = time.process_time() - cpu
writer.close()
print(json.dumps({"cpu": cpu, "jobs": len(ids)}))
"""


def make_jobs(url: str, n: int) -> list[str]:
    from common.domain import jobs
    from common.infra.db import get_database

    db = get_database(url)
    with db.session() as session:
        created = [jobs.new_job(model="m", request=REQUEST) for _ in range(n)]
        session.add_all(created)
    return [job.id for job in created]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=480)
    parser.add_argument("--groups", default="1,2,4,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--code", type=Path, action="append", default=[], help="another copy of the code")
    args = parser.parse_args()
    trees = [ROOT, *[path.resolve() for path in args.code]]
    sizes = [int(size) for size in args.groups.split(",")]
    postgres = PostgresCluster()
    runs: dict[tuple[Path, int], list[tuple[float, float]]] = {(tree, size): [] for tree in trees for size in sizes}
    try:
        postgres.init()
        postgres.start()
        from common.infra.migrate import upgrade

        upgrade(postgres.url)
        postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
        for rep in range(args.repeats):
            for size in sizes:
                for tree in trees:
                    ids = make_jobs(postgres.url, args.jobs + 8)
                    server = tree_cpu_seconds(postmaster)
                    out = subprocess.run([sys.executable, "-c", _CHILD, str(tree), postgres.url, json.dumps(ids),
                                          str(size)], capture_output=True, text=True, cwd=tree, check=True)
                    child = json.loads(out.stdout.strip().splitlines()[-1])
                    # The server's CPU includes the child's connection start-up, as it would a worker's.
                    server = tree_cpu_seconds(postmaster) - server
                    runs[(tree, size)].append((1000 * child["cpu"] / child["jobs"], 1000 * server / child["jobs"]))
            print(f"  repeat {rep + 1} done")
    finally:
        postgres.remove()
    print(f"\nclaim + finish of {args.jobs} jobs in groups, CPU per job in ms (medians of {args.repeats}):")
    print(f"{'code':<32}{'group':>6}{'worker':>9}{'postgres':>10}{'total':>8}   vs this tree")
    for size in sizes:
        base = statistics.median(w + p for w, p in runs[(ROOT, size)])
        for tree in trees:
            worker = statistics.median(w for w, _ in runs[(tree, size)])
            server = statistics.median(p for _, p in runs[(tree, size)])
            total = statistics.median(w + p for w, p in runs[(tree, size)])
            print(f"{str(tree)[-32:]:<32}{size:>6}{worker:>9.3f}{server:>10.3f}{total:>8.3f}   {total / base:.2f}x")


if __name__ == "__main__":
    main()
