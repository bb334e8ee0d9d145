"""The only contract between the scheduler (bookkeeping) and the model runner (tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int           # first position computed this step (= request.num_computed_tokens at schedule time)
    num_tokens: int      # positions computed this step: a prefill chunk, or 1 for a decode
    # True when this chunk reaches the end of the known tokens, so the step's logits at its last position
    # yield the request's next token; False for a non-final prefill chunk.
    samples: bool


@dataclass
class EncoderInput:
    request: Request
    image_index: int     # index into request.images
    content_hash: str


@dataclass
class SchedulerOutput:
    # Requests computed this step, in batch order: their tokens are packed in this order into one ragged batch.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Images the vision tower must encode this step (not in the encoder cache), one entry per distinct hash.
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    # Requests preempted this step (blocks freed, to be recomputed); the runner drops their per-step state.
    preempted: list[Request] = field(default_factory=list)
    # Requests finished or aborted since the last step; the runner frees their per-request tensors.
    finished_ids: list[str] = field(default_factory=list)
    # Content hashes the encoder cache evicted; the runner deletes their embedding tensors.
    evicted_hashes: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.encoder_inputs
