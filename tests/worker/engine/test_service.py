"""The thread front: many submitters, futures resolved as requests finish, aborts free everything."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tests.worker.engine.test_engine import make_requests
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.service import EngineService
from worker.inference.generation import InputError
from worker.inference.model_loader import load_model


@pytest.fixture
def service(tiny_llava_path: Path):
    svc = EngineService(Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, block_size=8)))
    yield svc
    svc.close()


def test_threads_submit_and_get_what_the_engine_alone_gives(service: EngineService, tiny_llava_path: Path) -> None:
    requests = make_requests(12, seed=31)
    alone = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, block_size=8))
    expected = {r.request_id: r.token_ids for r in alone.generate(requests)}
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda r: service.submit(service.prepare(r)).result(timeout=120), requests))
    assert {r.request_id: r.token_ids for r in results} == expected


def test_abort_stops_a_running_request(service: EngineService) -> None:
    long, short = make_requests(2, seed=32)
    long = replace(long, request_id="long", sampling=replace(long.sampling, max_tokens=400))
    doomed = service.submit(service.prepare(long))
    deadline = time.monotonic() + 30
    while service.engine.scheduler.num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    service.abort("long")  # a few steps into a run of ~400 tokens
    with pytest.raises(RuntimeError, match="aborted"):
        doomed.result(timeout=30)
    assert service.submit(service.prepare(short)).result(timeout=60).completion_tokens <= short.sampling.max_tokens
    engine = service.engine
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_request_that_can_never_fit_fails_alone(tiny_llava_path: Path) -> None:
    svc = EngineService(Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=2, block_size=4)))
    try:
        req = make_requests(1, seed=33)[0]
        with pytest.raises(InputError):
            svc.submit(svc.prepare(req)).result(timeout=30)
    finally:
        svc.close()


def test_a_poison_request_fails_alone_and_its_batch_mates_finish_unchanged(tiny_llava_path: Path) -> None:
    """A step that raises whenever one particular request is in it (a fault the model hits on that input)."""
    requests = make_requests(8, seed=34)
    alone = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, block_size=8))
    expected = {r.request_id: r.token_ids for r in alone.generate(requests)}
    poison = requests[3].request_id
    engine = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, block_size=8))
    execute = engine.runner.execute

    def faulty_execute(out):
        if any(s.request_id == poison for s in out.scheduled):
            raise FloatingPointError("a kernel fault on this input")
        return execute(out)

    engine.runner.execute = faulty_execute  # type: ignore[method-assign]
    svc = EngineService(engine)
    try:
        prepared = [svc.prepare(r) for r in requests]
        futures = {p.request.request_id: svc.submit(p) for p in prepared}  # all in flight together
        with pytest.raises(FloatingPointError):
            futures[poison].result(timeout=120)
        results = {rid: f.result(timeout=120).token_ids for rid, f in futures.items() if rid != poison}
        assert results == {rid: ids for rid, ids in expected.items() if rid != poison}
        # Back to normal batching afterwards.
        late = make_requests(2, seed=35)
        assert all(svc.submit(svc.prepare(r)).result(timeout=60).completion_tokens for r in late)
        assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
    finally:
        svc.close()


def _trickle(tiny_llava_path: Path, linger: float, gap: float) -> tuple[int, dict[str, list[int]]]:
    """Requests submitted one every `gap` seconds: the engine's steps and the tokens."""
    engine = Engine(load_model(str(tiny_llava_path)),
                    EngineConfig(num_kv_blocks=256, block_size=8, step_linger_seconds=linger))
    svc = EngineService(engine)
    try:
        futures = []
        for request in make_requests(10, seed=41):
            futures.append(svc.submit(svc.prepare(request)))
            time.sleep(gap)
        results = [f.result(timeout=120) for f in futures]
        return engine.stats.num_steps, {r.request_id: r.token_ids for r in results}
    finally:
        svc.close()


def test_linger_gathers_a_trickle_into_fewer_steps_with_the_same_tokens(tiny_llava_path: Path) -> None:
    """Requests arriving slower than the engine steps: without the linger it steps on each one as it comes
    (several decode steps between arrivals); with it, it waits for the next arrival while they keep coming."""
    steps_at_once, tokens_at_once = _trickle(tiny_llava_path, 0.0, gap=0.02)
    steps_lingering, tokens_lingering = _trickle(tiny_llava_path, 0.05, gap=0.02)
    assert tokens_lingering == tokens_at_once
    assert steps_lingering < steps_at_once, (steps_lingering, steps_at_once)


def test_linger_does_not_hold_a_lone_request(tiny_llava_path: Path) -> None:
    """Once nothing more arrives the engine steps at once: a lone request waits one linger at most, not one per
    step (it would take 16 x 0.25 s here)."""
    engine = Engine(load_model(str(tiny_llava_path)),
                    EngineConfig(num_kv_blocks=256, block_size=8, step_linger_seconds=0.25))
    svc = EngineService(engine)
    try:
        request = make_requests(1, seed=42)[0]
        request = replace(request, sampling=replace(request.sampling, max_tokens=16))
        started = time.monotonic()
        result = svc.submit(svc.prepare(request)).result(timeout=60)
        assert result.completion_tokens >= 12, result  # else the bound below would not tell
        assert time.monotonic() - started < 2.0
    finally:
        svc.close()
