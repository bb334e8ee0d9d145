"""The queue's own ceiling: batch rows through the deployed stack with a model that answers at once.

    .venv/bin/python bench/queue_ceiling.py --rows 2000 --repeats 2

Each service runs as compose runs it (bench/service_stack.py: `vlmq api`, `vlmq worker`, `vlmq ingest-worker
--beat`, their own redis-server and Postgres cluster, moto's S3 server), the worker with `VLMQ_BACKEND=null`
(worker/inference/null_generator.py): every row is still templated, tokenised and, for image rows, decoded and run
through the checkpoint's image processor, but nothing is generated. One OpenAI Batch API file goes in (upload ->
ingest -> dispatch -> worker -> finalize -> output file), timed to the batch's `completed`, for text rows and
for rows with a 96 px image each. What it prints is what the queue costs a row: the rows/s a worker could
never exceed, however fast a GPU makes the model, and the CPU each process spends per row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from compare import MODELS, make_jobs, run_service  # noqa: E402
from engine import cpu_name  # noqa: E402

from tests.s3_server import S3Server  # noqa: E402
from worker.inference.tiny_model import build_tiny_llava  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kinds", default="text,image", help="text, image (a 96 px picture per row)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every service process (VLMQ_KEY=VALUE)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy every thread of the API and the worker on a CPU: file prefix")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    settings = {"backend": "null", **dict(pair.split("=", 1) for pair in args.set)}
    print(f"CPU: {cpu_name()}; {args.rows} rows per batch, settings {settings}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        s3 = S3Server("moto")
        try:
            path = build_tiny_llava(work / "tiny", seed=0, spec=MODELS["tiny"])
            for kind in args.kinds.split(","):
                jobs = make_jobs(args.rows, kind == "image", max_tokens=1, image_size=(96, 96))
                rates = []
                for rep in range(args.repeats):
                    run = run_service(path, jobs, 1, work / f"{kind}-{rep}", s3.endpoint, s3.pid, batch=True,
                                      label=f"null-{kind}", settings=settings,
                                      profile=args.profile and Path(f"{args.profile}-{kind}-{rep}"),
                                      profile_cpu=True)
                    assert len(run.tokens) == args.rows, f"{len(run.tokens)} of {args.rows} rows in the output"
                    rates.append(args.rows / run.seconds)
                    print(f"{kind} rows, run {rep + 1}: {run.seconds:.2f} s, {rates[-1]:.0f} rows/s")
                print(f"== {kind} rows: median {statistics.median(rates):.0f} rows/s "
                      f"({', '.join(f'{r:.0f}' for r in rates)})")
        finally:
            s3.close()


if __name__ == "__main__":
    main()
