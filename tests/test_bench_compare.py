"""bench/compare.py's service run in its smallest size: vlmq deployed as compose deploys it (bench/
service_stack.py: api, worker and maintenance as their own processes, own Redis and Postgres, the S3 server
spoken to directly) answers every job the same as the engine alone, and each part's CPU is accounted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_service_run_agrees_with_the_engine_and_accounts_cpu(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--jobs", "6", "--models", "tiny",
                          "--systems", "engine,service", "--max-tokens", "6", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    service = [r for r in rows if r["system"] == "service"]
    assert {r["kind"] for r in service} == {"image", "text"}
    assert all(r["agreement"] == "6/6" and r["jobs_per_s"] > 0 for r in service), service
    cpu_lines = re.findall(r"service CPU per job \(ms\): (.*?);", run.stdout)
    assert len(cpu_lines) == 2
    for line in cpu_lines:
        parts = dict(item.rsplit(" ", 1) for item in line.split(", "))
        assert set(parts) == {"api", "maintenance", "worker", "postgres", "redis", "s3", "client"}
        assert float(parts["worker"]) > 0 and float(parts["api"]) > 0 and float(parts["s3"]) > 0
    assert len(re.findall(r"service timeline .* claimed [\d.]+-[\d.]+, finished [\d.]+-[\d.]+", run.stdout)) == 2
