"""The model runner's whole input, one step at a time: plain values, no reference to the scheduler's objects.

As in vLLM v1, the runner keeps state of its own per request (token ids, block table, image inputs, sampling)
and its own image embeddings by content hash, and brings them up to date from each step's output in this
order: drop finished requests, drop freed embeddings, clear preempted block tables, add new requests, extend
the block tables of the scheduled ones. Then it encodes `encoder_inputs` and computes `scheduled`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.core.request import ImageItem
from worker.inference.generation import SamplingParams


@dataclass
class NewRequestData:
    """A request at its first schedule: all the runner keeps of it until its id comes back in `finished_ids`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageItem]  # where each image's embedding goes in the prompt, and its content hash
    # What the runner's own prepare() made of the prompt besides its token ids (per-image pixel tensors,
    # M-RoPE positions). Opaque here: the scheduler hands it over untouched, so this package needs no torch.
    model_inputs: object


@dataclass
class ScheduledRequest:
    request_id: str
    start: int           # first position computed this step (= the request's computed tokens at schedule time)
    num_tokens: int      # positions computed this step: a prefill chunk, or 1 for a decode
    # True when this chunk reaches the end of the known tokens, so the step's logits at its last position
    # yield the request's next token; False for a non-final prefill chunk.
    samples: bool
    # KV blocks the request got this step, to append to its block table: the whole table when it is
    # admitted (new, or back after a preemption), the blocks it grew by otherwise (often none).
    new_block_ids: list[int]


@dataclass
class EncoderInput:
    request_id: str      # a request scheduled this step
    image_index: int     # index into that request's images
    content_hash: str


@dataclass
class SchedulerOutput:
    # Requests scheduled for the first time, before `scheduled` refers to them.
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests computed this step, in batch order: their tokens are packed in this order into one ragged batch.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Images the vision tower must encode this step (not in the encoder cache), one entry per distinct hash.
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    # Requests preempted this step: their blocks are freed, so the runner clears their block tables; their
    # tokens stay, to be recomputed when they are admitted again.
    preempted_ids: list[str] = field(default_factory=list)
    # Requests finished or aborted since the last step; the runner drops everything it holds for them.
    finished_ids: list[str] = field(default_factory=list)
    # Content hashes the encoder cache no longer holds (evicted, or reserved by a step that never finished);
    # the runner deletes their embeddings before this step encodes anything.
    freed_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.encoder_inputs
