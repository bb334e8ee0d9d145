"""A generation request as the engine's bookkeeping sees it. No torch: tensors live in the model runner."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from worker.inference.generation import SamplingParams

_arrival = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"   # EOS or a stop string
    FINISHED_LENGTH = "finished_length"     # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class ImageItem:
    """One image's run of placeholder positions in the prompt."""

    content_hash: str  # identity of the image's pixels as preprocessed; equal hashes share embeddings
    offset: int        # index in prompt_token_ids of its first placeholder position
    num_tokens: int    # placeholder positions it fills (= embedding rows the vision tower yields)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def images_in(images: list[ImageItem], start: int, end: int) -> list[ImageItem]:
    """Those of `images` whose placeholder run overlaps positions [start, end)."""
    return [im for im in images if im.offset < end and im.end > start]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageItem] = field(default_factory=list)  # sorted by offset, non-overlapping
    priority: int = 0          # higher runs first
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None  # prompt + output never exceed this
    cache_salt: str = ""  # prefix-cache blocks are shared only between requests of the same salt
    # The runner's tensors for this prompt (see NewRequestData.model_inputs), held only until the request's
    # first schedule hands them to the runner.
    model_inputs: object = None
    arrival: int = field(default_factory=lambda: next(_arrival))

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0   # positions whose KV is in the cache (incl. prefix-cache hits)
    num_cached_tokens: int = 0     # of those, how many came from the prefix cache at the last admission
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: str | None = None  # the stop string that ended it, if any

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        limit = self.sampling.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - self.num_prompt_tokens)
        return max(limit, 0)

    def images_in(self, start: int, end: int) -> list[ImageItem]:
        """Images whose placeholder run overlaps positions [start, end)."""
        return images_in(self.images, start, end)

    def __hash__(self) -> int:
        return hash(self.request_id)
