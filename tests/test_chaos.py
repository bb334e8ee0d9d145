"""bench/chaos.py in its CI size: 200 jobs, two random worker SIGKILLs, one Redis restart (empty) and one
Postgres crash-restart, against an undisturbed run of the same size. Nothing lost, stuck or duplicated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_chaos_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    # Long enough answers that the run outlasts its faults: each fires as a share of the jobs is done, and a
    # fast worker finished 200 jobs of 16 tokens within one Redis restart.
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--jobs", "200", "--kills", "2",
                          "--max-tokens", "96", "--check", "--json", str(out), "--timeout", "300"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    undisturbed, chaos = summary["runs"]
    for r in (undisturbed, chaos):
        assert r["statuses"] == {"succeeded": 200}, r
        assert (r["lost"], r["stuck"], r["duplicated"], r["missing_result"], r["over_attempts"]) == (0, 0, 0, 0, 0)
    events = " ".join(chaos["events"])
    assert events.count("SIGKILL") == 2 and "redis restarted" in events and "postgres crash-restarted" in events
    assert "lost=0 duplicated=0 stuck=0 clean=True" in run.stdout
