"""bench/compare.py's service run in its smallest size: vlmq deployed as compose deploys it (bench/
service_stack.py: api, worker and maintenance as their own processes, own Redis and Postgres, the S3 server
spoken to directly) answers every job the same as the engine alone, and each part's CPU is accounted."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_service_runs_agree_with_the_engine_and_account_cpu(tmp_path: Path) -> None:
    """Both ways in: each job POSTed (service), and one Batch API file (service_batch), whose texts come back
    from the batch's output file; every job starts with the same system prompt. Each against both S3 servers
    (moto's, and rclone's Go one), labelled by server. Images of a size other than the default, not square."""
    out = tmp_path / "compare.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--jobs", "6", "--models", "tiny",
                          "--systems", "engine,service,service_batch", "--max-tokens", "6", "--json", str(out),
                          "--system-prompt", "You label images. Answer in one short sentence.", "--s3", "moto,rclone",
                          "--image-size", "320x240"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^## tiny, image jobs: 6 jobs of 320x240 px, ", run.stdout, re.M), run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["system"] for r in rows} == {"engine", "service+moto", "service+rclone", "service_batch+moto",
                                           "service_batch+rclone"}
    for system in ("service+moto", "service+rclone", "service_batch+moto", "service_batch+rclone"):
        service = [r for r in rows if r["system"] == system]
        assert {r["kind"] for r in service} == {"image", "text"}
        assert all(r["agreement"] == "6/6" and r["jobs_per_s"] > 0 for r in service), service
        cpu_lines = re.findall(rf"^  {re.escape(system)} CPU per job \(ms\): (.*?);", run.stdout, re.M)
        assert len(cpu_lines) == 2
        for line in cpu_lines:
            parts = dict(item.rsplit(" ", 1) for item in line.split(", "))
            assert set(parts) == {"api", "maintenance", "worker", "engine", "postgres", "redis", "s3", "client"}
            # /proc counts CPU in 10 ms ticks: rclone's server may spend less than one on 6 jobs, and so may
            # moto's and the API on a batch's (one upload, one create; its images in one pack: one PUT, one read).
            busy = ("worker", "engine") + (("api",) if system.startswith("service+") else ()) + (
                ("s3",) if system == "service+moto" else ())
            assert all(float(parts[name]) > 0 for name in busy), (system, parts)
        # The batch's rows are written and dispatched by the ingest worker (maintenance here), and it writes
        # the output file.
        if system.startswith("service_batch"):
            assert all(float(dict(item.rsplit(" ", 1) for item in line.split(", "))["maintenance"]) > 0
                       for line in cpu_lines), cpu_lines
        timelines = re.findall(rf"^  {re.escape(system)} timeline .* claimed [\d.]+-[\d.]+, finished [\d.]+-[\d.]+",
                               run.stdout, re.M)
        assert len(timelines) == 2, run.stdout
        # The engine's steps in the service (read from the worker's Prometheus port): 6 jobs of 6 tokens take
        # at least 6 steps, and the image run's jobs went through at least one vision batch.
        inside = re.findall(rf"^  {re.escape(system)} engine: (\d+) steps(?:, (\d+) vision batches)?", run.stdout, re.M)
        assert len(inside) == 2 and all(int(steps) >= 6 for steps, _ in inside), run.stdout
        assert int(inside[0][1] or 0) >= 1, run.stdout  # images run first
    alone = [int(n) for n in re.findall(r"engine alone: [\d.]+ ms of CPU per job, (\d+) steps", run.stdout)]
    assert len(alone) == 2 and min(alone) >= 6, run.stdout
    assert "logged" not in run.stdout, run.stdout  # no part warned or failed on the way


def test_an_image_size_it_cannot_use_is_refused_before_any_work() -> None:
    for size in ("10x10", "640", "640x480x3", "axb"):
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--image-size", size],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2 and "--image-size" in run.stderr and "WIDTHxHEIGHT" in run.stderr, run.stderr


def test_a_service_variant_runs_beside_the_service_with_its_settings(tmp_path: Path) -> None:
    """--service-set LABEL:KEY=VALUE: the same jobs through a stack whose processes got VLMQ_KEY=VALUE, labelled
    service+LABEL; each run says how long the worker's garbage collections took. A bad spec is refused."""
    out = tmp_path / "compare.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--jobs", "4", "--models", "tiny",
                          "--systems", "engine,service", "--max-tokens", "4", "--json", str(out),
                          "--service-set", "nofreeze:gc_freeze=false"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["system"] for r in rows} == {"engine", "service", "service+nofreeze"}
    assert all(r["agreement"] == "4/4" for r in rows if r["system"] != "engine"), rows
    for system in ("service", "service+nofreeze"):
        lines = re.findall(rf"^  {re.escape(system)} worker's garbage collections: generation 0 \d+ \([\d.]+ ms\), "
                           r"generation 1 \d+ \([\d.]+ ms\), generation 2 \d+ \([\d.]+ ms\); (\d+) objects frozen$",
                           run.stdout, re.M)
        assert len(lines) == 2, run.stdout
        # The variant's processes had its settings: its worker froze nothing, the default one its start-up heap.
        assert all((int(n) == 0) == (system == "service+nofreeze") for n in lines), (system, lines)
    for bad in ("nofreeze", "Bad:gc_freeze=false", ":gc_freeze=false"):
        refused = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--systems", "engine",
                                  "--service-set", bad], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert refused.returncode == 2 and "--service-set" in refused.stderr, refused.stderr


def _code_copy(tmp_path: Path) -> Path:
    """A second copy of the code, as a bench's `--code DIR` takes it."""
    copy = tmp_path / "code"
    for part in ("api", "cli", "common", "worker"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_bf16_runs_every_system_in_bf16(tmp_path: Path) -> None:
    """--dtype bfloat16: the engine and HF run bf16 weights (so the engine's KV cache is bf16 too), the GEMM
    peak is bf16's, and the JSON says which dtype its numbers are for."""
    out = tmp_path / "compare.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--jobs", "4", "--models", "tiny",
                          "--systems", "engine,hfb", "--max-tokens", "4", "--dtype", "bfloat16", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^CPU: .* threads, bfloat16; GEMM \d+\^2 peak measured now: \d+ GFLOP/s", run.stdout, re.M)
    assert len(re.findall(r"^  engine alone: .*; KV cache in bfloat16$", run.stdout, re.M)) == 2, run.stdout
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["peak_gflops"] > 0
    rows = report["rows"]
    assert {(r["system"], r["kind"]) for r in rows} == {(s, k) for s in ("engine", "hfb") for k in ("image", "text")}
    assert all(r["jobs_per_s"] > 0 and re.fullmatch(r"ref|\d/4", r["agreement"]) for r in rows), rows
    # The image tax's floor: the vision tower plus the image tokens' LM work, which add up to the extra FLOPs.
    need = re.search(r"^  image jobs need ([\d.]+) GFLOP more than text jobs: vision ([\d.]+), their image tokens "
                     r"through the LM ([\d.]+) \(([\d.]+)s at the peak\); floor of the tax ([\d.]+)s$",
                     run.stdout, re.M)
    assert need, run.stdout
    extra, vision, lm, _, floor = map(float, need.groups())
    assert vision > 0 and lm > 0 and floor > 0 and abs(extra - vision - lm) <= 0.002, need.group(0)
    # On 4 tiny jobs the tax is within timing noise, so either sign is a valid measurement.
    assert len(re.findall(r"^  (engine|hfb) +image jobs took [+-][\d.]+s over text jobs = -?[\d.]+x the vision time, "
                          r"-?[\d.]+x the floor$", run.stdout, re.M)) == 2, run.stdout


def test_finalize_bench_runs_side_by_side(tmp_path: Path) -> None:
    """bench/finalize.py in its smallest size, against a second copy of the code: both finalize the batch."""
    copy = _code_copy(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "finalize.py"), "--jobs", "40", "--repeats", "1",
                          "--code", str(copy)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = re.findall(r"^(\S+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", run.stdout, re.M)
    assert [Path(r[0]) for r in rows] == [ROOT, copy.resolve()], run.stdout
    assert all(int(r[2]) > 0 for r in rows), run.stdout


def test_state_writes_bench_runs_side_by_side(tmp_path: Path) -> None:
    """bench/state_writes.py in its smallest size, against a second copy of the code: both trees claim and
    finish every job of every group size (the child asserts each answer) and report CPU per job."""
    copy = _code_copy(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "state_writes.py"), "--jobs", "24", "--groups", "1,8",
                          "--repeats", "1", "--code", str(copy)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = re.findall(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$", run.stdout, re.M)
    assert [(r[0][-12:], int(r[1])) for r in rows] == [
        (str(tree)[-12:], size) for size in (1, 8) for tree in (ROOT, copy.resolve())], run.stdout
    assert all(float(r[2]) > 0 for r in rows), run.stdout  # Postgres counts in 10 ms ticks: may read 0 here


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_trees_bench_runs_both_trees(tmp_path: Path, dtype: str) -> None:
    """bench/engine_trees.py in its smallest size, against a second copy of the code: each tree's engine runs its
    turn in a process of its own, in the dtype asked for, and two copies of one tree generate the same tokens."""
    copy = _code_copy(tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_trees.py"), "--before", str(copy),
                          "--models", "tiny", "--jobs", "4", "--max-tokens", "4", "--turns", "1", "--rounds", "2",
                          "--dtype", dtype], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.splitlines()[0].endswith(f"2 threads, {dtype}"), run.stdout
    turns = re.findall(r"^  tiny (text|image) (before|after) turn 1: ([\d.]+) ([\d.]+)$", run.stdout, re.M)
    assert sorted((kind, name) for kind, name, *_ in turns) == [
        ("image", "after"), ("image", "before"), ("text", "after"), ("text", "before")], run.stdout
    summary = re.findall(r"^tiny (text|image): before [\d.]+ s, after [\d.]+ s \(medians of 2\): [\d.]+x; "
                         r"tokens the same$", run.stdout, re.M)
    assert summary == ["text", "image"], run.stdout


def test_linear_shapes_bench_times_every_shape_in_both_dtypes() -> None:
    """bench/linear_shapes.py once through: first and cached calls at each row count, and separate against merged
    projections, in fp32 (packed) and bf16."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "linear_shapes.py"), "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    firsts = re.findall(r"^ +(\d+) rows: first call +([\d.]+) +cached +([\d.]+) +([\d.]+)x$", run.stdout, re.M)
    assert [int(rows) for rows, *_ in firsts] == [3, 17, 129, 333, 1001, 2999] * 2, run.stdout
    assert all(float(cached) > 0 for _, _, cached, _ in firsts), run.stdout
    merged = re.findall(r"^ +(\d+) rows: q,k,v +[\d.]+ -> qkv +[\d.]+ \(([\d.]+)x\) +gate,up +[\d.]+ -> gate_up "
                        r"+[\d.]+ \(([\d.]+)x\)$", run.stdout, re.M)
    assert [int(rows) for rows, *_ in merged] == [256, 1024, 4096] * 2, run.stdout
    assert [line for line in run.stdout.splitlines() if line.startswith("torch.")] == [
        "torch.float32: [rows, 512] x [512, 1536], ms", "torch.float32: separate matmuls against one merged, ms",
        "torch.bfloat16: [rows, 512] x [512, 1536], ms", "torch.bfloat16: separate matmuls against one merged, ms"]


def test_vlmq_run_and_hf_batches_run_in_processes_of_their_own(tmp_path: Path) -> None:
    """`run` (vlmq run of the jobs as a batch file) answers as the engine alone does, timed by its run phase once
    loaded; `hfb_process` (HF padded batches with transformers' own classes) answers text jobs as the engine
    does, timed by its whole wall."""
    out = tmp_path / "compare.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--jobs", "4", "--models", "tiny",
                          "--systems", "engine,run,hfb_process", "--max-tokens", "4", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {(r["system"], r["kind"]): r for r in json.loads(out.read_text())["rows"]}
    assert {system for system, _ in rows} == {"engine", "run", "hfb_process"}
    for kind in ("image", "text"):
        assert rows[("run", kind)]["agreement"] == "4/4"
    assert rows[("hfb_process", "text")]["agreement"] == "4/4"  # images: HF's own processor resizes with Pillow
    phases = re.findall(r"^  run: run phase ([\d.]+) s, ([\d.]+) s of it with the model loaded; wall ([\d.]+) s",
                        run.stdout, re.M)
    assert len(phases) == 2 and all(float(a) >= float(b) > 0 and float(w) > float(a) for a, b, w in phases)
    walls = re.findall(r"^  hfb_process: wall ([\d.]+) s; loaded in", run.stdout, re.M)
    assert len(walls) == 2 and all(float(w) > 0 for w in walls)
