"""The engine's sampler at the edges of its parameters: values float32 cannot tell from 0 must not turn the
probabilities into NaN (the job would fail every attempt), and a seed gives the same draws whatever shares
the step."""

from __future__ import annotations

import torch

from worker.engine.sampler import Sampler, top_p_filter
from worker.inference.generation import SamplingParams


def test_tiny_temperature_and_top_p_give_the_most_likely_token() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=5e-324),
              SamplingParams(temperature=1.0, top_p=5e-324),
              SamplingParams(temperature=2.0, top_p=1e-300, seed=-(2**63)),
              SamplingParams(temperature=0.7, top_p=1e-45, top_k=3, seed=2**63 - 1)]
    tokens = Sampler(torch.device("cpu")).sample(logits, [f"r{i}" for i in range(5)], params)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_nucleus_and_always_the_top_token() -> None:
    scores = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    kept = torch.isfinite(top_p_filter(scores, 0.7)).tolist()
    assert kept == [False, True, True, False]  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it
    assert torch.isfinite(top_p_filter(scores, 1e-300)).tolist() == [False, True, False, False]


def test_a_seed_draws_the_same_tokens_whatever_shares_the_step() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeded, unseeded = SamplingParams(temperature=1.0, seed=99), SamplingParams(temperature=1.0)
    cpu = torch.device("cpu")

    def draws(rows: list[int], ids: list[str], params: list[SamplingParams], steps: int = 4) -> list[list[int]]:
        sampler = Sampler(cpu)
        return [sampler.sample(logits[rows], ids, params) for _ in range(steps)]

    alone = [step[0] for step in draws([0], ["a"], [seeded])]
    first = [step[1] for step in draws([1, 0, 2], ["b", "a", "c"], [unseeded, seeded, unseeded])]
    last = [step[2] for step in draws([2, 1, 0], ["x", "y", "a"], [unseeded, unseeded, seeded])]
    assert alone == first == last
