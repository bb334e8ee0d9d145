"""Next-token choice per request: greedy, or temperature / top-k / top-p from the request's own generator.

A request's generator is seeded once from its `seed` and advanced only by its own draws, so the same seed
gives the same output whatever else shares the batch.
"""

from __future__ import annotations

import secrets

import torch

from worker.inference.generation import SamplingParams


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else secrets.randbits(63))
            self._generators[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [B, vocab] for the rows that sample this step."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens: list[int] = []
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if p.greedy:
                tokens.append(int(greedy[row]))
                continue
            scores = logits[row].float() / p.temperature
            if 0 < p.top_k < scores.shape[-1]:
                kth = torch.topk(scores, p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if p.top_p < 1.0:
                scores = top_p_filter(scores, p.top_p)
            probs = torch.softmax(scores, dim=-1)
            token = torch.multinomial(probs, 1, generator=self._generator(request_id, p.seed))
            tokens.append(int(token))
        return tokens


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`scores` (one row) with every token outside the top_p nucleus set to -inf."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    drop_sorted[0] = False  # a top_p under float32's smallest value would otherwise drop it too
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
