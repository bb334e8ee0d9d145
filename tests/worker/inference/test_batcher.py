"""worker/inference/batcher.py: greedy cross-job batching in front of the HF backend, with a backend that stands
in for it."""

from __future__ import annotations

import pytest

from worker.inference.batcher import BatchingGenerator, EngineGenerator
from worker.inference.generation import GenerationResult, InputError


class _Backend:
    """Fails any batch holding a request named in `failures` with that error; answers the rest."""

    def __init__(self, failures: dict[str, Exception]) -> None:
        self.failures = failures
        self.batches: list[list[str]] = []

    def prepare(self, req: str) -> str:
        return req

    def generate(self, batch: list[str]) -> list[GenerationResult]:
        self.batches.append(batch)
        for name in batch:
            if name in self.failures:
                raise self.failures[name]
        return [GenerationResult(name, f"answer to {name}", [1], "stop", 2, 1) for name in batch]


def _run(backend: _Backend, names: list[str]) -> dict[str, GenerationResult | BaseException]:
    generator = BatchingGenerator(backend, max_batch_size=8, batch_wait_s=0.2)  # type: ignore[arg-type]
    try:
        futures = {name: generator.submit(generator.prepare(name)) for name in names}  # type: ignore[arg-type]
        return {name: f.exception(30) or f.result() for name, f in futures.items()}
    finally:
        generator.close()


def test_a_request_the_model_refuses_fails_alone_as_bad_input_and_its_batch_mates_finish() -> None:
    """The model's own ValueError for one request (its image features and placeholders disagree, say) would
    recur on every attempt: the job fails at once instead of being retried, and the rest still run."""
    mismatch = ValueError("Image features and image tokens do not match: tokens: 4, features 8")
    backend = _Backend({"bad": mismatch})
    outcomes = _run(backend, ["a", "bad", "b"])
    refusal = outcomes["bad"]
    assert isinstance(refusal, InputError) and "Image features and image tokens do not match" in str(refusal)
    assert refusal.__cause__ is mismatch
    assert {name: getattr(o, "text", None) for name, o in outcomes.items() if name != "bad"} == {
        "a": "answer to a", "b": "answer to b"}
    assert ["bad"] in backend.batches  # isolated after its batch failed


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), OSError("disk"),
                                   InputError("already a refusal")])
def test_other_failures_stay_what_they_were(error: Exception) -> None:
    """Anything but a plain ValueError may pass (memory, a device, I/O) and is retried by the pipeline."""
    outcome = _run(_Backend({"x": error}), ["x"])["x"]
    assert outcome is error


def test_only_the_paged_engines_inputs_may_be_prepared_elsewhere() -> None:
    """worker/context.py builds a prepare pool only for an EngineGenerator: the engine in this process or in a
    child is one, and so is the null generator that stands in for it; the HF batcher (its inputs are its own)
    is not."""
    from worker.engine.process import EngineProcess
    from worker.engine.service import EngineService
    from worker.inference.null_generator import NullGenerator

    for front in (EngineService, EngineProcess, NullGenerator):
        assert isinstance(object.__new__(front), EngineGenerator)
    assert not isinstance(object.__new__(BatchingGenerator), EngineGenerator)
