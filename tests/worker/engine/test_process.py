"""The engine in a child process: the same tokens as the engine in this one, errors that keep their type,
aborts, metrics, and a child that dies and is replaced without losing the requests that come after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tests.worker.engine.test_engine import make_requests
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.process import EngineDied, EngineProcess, EngineSpec
from worker.inference.generation import InputError
from worker.inference.model_loader import load_model

CONFIG = EngineConfig(num_kv_blocks=256, block_size=8)


def spec_for(path: Path, config: EngineConfig = CONFIG, device: str = "cpu") -> EngineSpec:
    return EngineSpec(model=str(path), device=device, dtype="float32", config=config)


@pytest.fixture(scope="module")
def llava_process(tiny_llava_path: Path):
    process = EngineProcess(spec_for(tiny_llava_path))
    yield process
    process.close()


@pytest.mark.parametrize("fixture", ["tiny_llava_path", "tiny_qwen2_vl_path", "tiny_internvl_path"])
def test_threads_get_the_tokens_the_engine_gives_in_process(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    requests = make_requests(10, seed=41)  # text, one image, two images; M-RoPE positions for qwen2_vl
    expected = {r.request_id: r.token_ids for r in Engine(load_model(str(path)), CONFIG).generate(requests)}
    process = EngineProcess(replace(spec_for(path), gc_freeze=True))  # as a worker starts it (VLMQ_GC_FREEZE)
    try:
        assert process.pid != os.getpid()
        # The child froze what building the engine left (torch, transformers, the model) out of its collector's
        # scans before taking requests; the tokens below are the same.
        assert process.ready_info["gc_frozen_objects"] > 50_000  # type: ignore[operator]
        with ThreadPoolExecutor(5) as pool:
            results = list(pool.map(lambda r: process.submit(process.prepare(r)).result(timeout=120), requests))
    finally:
        process.close()
    assert {r.request_id: r.token_ids for r in results} == expected
    assert all(r.completion_tokens == len(r.token_ids) for r in results)


def test_prepare_needs_no_weights(llava_process: EngineProcess) -> None:
    assert llava_process.ready_info["gc_frozen_objects"] == 0  # not asked for by its spec
    assert llava_process._front.device.type == "meta"
    prepared = llava_process.prepare(make_requests(1, seed=42, shared_image=None)[0])
    assert prepared.request.images == []  # the pixels cross the pipe, the PIL images do not


def test_input_error_crosses_the_pipe_as_itself(tiny_llava_path: Path) -> None:
    process = EngineProcess(spec_for(tiny_llava_path, EngineConfig(num_kv_blocks=2, block_size=4)))
    try:
        with pytest.raises(InputError, match="KV"):
            process.submit(process.prepare(make_requests(1, seed=43)[0])).result(timeout=60)
    finally:
        process.close()


def test_abort_fails_the_request_and_frees_the_child(llava_process: EngineProcess) -> None:
    long, short = make_requests(2, seed=44)
    long = replace(long, request_id="long", sampling=replace(long.sampling, max_tokens=400))
    doomed = llava_process.submit(llava_process.prepare(long))
    time.sleep(0.2)
    llava_process.abort("long")
    with pytest.raises(RuntimeError, match="aborted"):
        doomed.result(timeout=30)
    assert llava_process.submit(llava_process.prepare(short)).result(timeout=60).completion_tokens >= 1


def test_metrics_arrive_from_the_child(llava_process: EngineProcess) -> None:
    before = llava_process.metrics().get("generated_tokens", 0)
    requests = make_requests(4, seed=45)
    results = [f.result(timeout=60) for f in [llava_process.submit(llava_process.prepare(r)) for r in requests]]
    expected = before + sum(r.completion_tokens for r in results)
    deadline = time.monotonic() + 10  # a snapshot comes once a second
    def settled(m: dict[str, float]) -> bool:
        return m.get("generated_tokens", 0) >= expected and m.get("requests_running", 1) == 0

    while not settled(llava_process.metrics()) and time.monotonic() < deadline:
        time.sleep(0.1)
    metrics = llava_process.metrics()
    assert metrics["generated_tokens"] >= expected and metrics["steps"] > 0
    assert metrics["requests_running"] == 0 and metrics["requests_waiting"] == 0
    assert sum(llava_process.vision_batch_sizes) >= 1


def test_a_killed_child_fails_its_requests_and_is_replaced(tiny_llava_path: Path) -> None:
    process = EngineProcess(spec_for(tiny_llava_path))
    try:
        first_pid = process.pid
        long = replace(make_requests(1, seed=46)[0], request_id="long")
        long = replace(long, sampling=replace(long.sampling, max_tokens=100_000))
        held = process.submit(process.prepare(long))
        time.sleep(0.3)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(EngineDied, match="-9"):
            held.result(timeout=30)
        # Submitted while the new child starts: waits for it instead of failing.
        after = make_requests(3, seed=47)
        results = [process.submit(process.prepare(r)).result(timeout=120) for r in after]
        assert [r.request_id for r in results] == [r.request_id for r in after]
        assert process.num_restarts == 1 and process.pid != first_pid
    finally:
        process.close()


def test_the_child_leaves_sigterm_and_sigint_to_its_parent(llava_process: EngineProcess) -> None:
    """A group-wide SIGTERM (systemd, Ctrl-C) must not kill the engine under a worker's warm shutdown."""
    pid = llava_process.pid
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    result = llava_process.submit(llava_process.prepare(make_requests(1, seed=49)[0])).result(timeout=60)
    assert result.completion_tokens >= 1 and llava_process.pid == pid and llava_process.num_restarts == 0


def _process_state(pid: int) -> str:
    """'R', 'S', ... while it lives; 'Z' once exited (not yet reaped); 'gone' once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_the_child_exits_when_its_parent_is_killed(tiny_llava_path: Path) -> None:
    """No orphan engine keeps the model's memory (a GPU's, in production) after its worker is SIGKILLed."""
    spec = f"EngineSpec({str(tiny_llava_path)!r}, 'cpu', 'float32', EngineConfig(num_kv_blocks=64))"
    script = ("import time\n"
              "from worker.engine.core.config import EngineConfig\n"
              "from worker.engine.process import EngineProcess, EngineSpec\n"
              f"print(EngineProcess({spec}).pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=Path(__file__).parents[3])
    try:
        child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert _process_state(child_pid) not in ("Z", "gone")
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _process_state(child_pid) not in ("Z", "gone") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_state(child_pid) in ("Z", "gone")
    finally:
        parent.kill()


def test_a_child_that_cannot_build_the_engine_says_why(tiny_llava_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"engine process failed to start: .*nope"):
        EngineProcess(spec_for(tiny_llava_path, device="nope"))


def test_submit_after_close_is_refused_and_the_child_is_gone(tiny_llava_path: Path) -> None:
    process = EngineProcess(spec_for(tiny_llava_path))
    child = process._process
    process.close()
    assert child.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        process.submit(process.prepare(make_requests(1, seed=48)[0]))


def _niceness(pid: int, tid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_child_runs_below_its_parent_by_the_spec_nice(tiny_llava_path: Path) -> None:
    """Every thread of the engine process (its OpenMP pool included, made after the nice) yields to the
    worker's threads that feed it; the worker itself keeps its own priority."""
    process = EngineProcess(replace(spec_for(tiny_llava_path), nice=5))
    try:
        process.submit(process.prepare(make_requests(1, seed=47)[0])).result(timeout=60)
        threads = [int(tid) for tid in os.listdir(f"/proc/{process.pid}/task")]
        mine = _niceness(os.getpid(), os.getpid())
        assert len(threads) > 1
        assert {_niceness(process.pid, tid) for tid in threads} == {min(mine + 5, 19)}
    finally:
        process.close()
    assert _niceness(os.getpid(), os.getpid()) == mine
