"""The contract between the worker pipeline and any model backend.

Torch-free on purpose: the job-handling side of the worker (claiming, image loading, persisting results)
builds and reads these objects without importing a model stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image


MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    # 0 means greedy: the same request always gives the same tokens, whatever batch it lands in.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k filtering
    # With a seed, a sampled request is reproducible on its own, independent of the other jobs in its batch.
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow float32 (1e-40 is subnormal): the request asked for the
        # most likely token anyway, so it gets it.
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        """Raise InputError for values no backend can honour (checked before any model work)."""
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InputError("stop strings must be non-empty")


@dataclass
class GenerationRequest:
    request_id: str
    # HF chat format: {"role": ..., "content": [{"type": "text", "text": ...} | {"type": "image"}]};
    # content may also be a plain str.
    messages: list[dict[str, Any]]
    # RGB, in the order of the {"type": "image"} parts across all messages.
    images: list[Image.Image]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # higher runs first
    # Requests reuse each other's cached prompt blocks and image embeddings only under the same salt. The
    # pipeline gives each job its tenant's: a hit makes a job faster, so shared caches would let one tenant
    # confirm another's prompt or image by timing its own.
    cache_salt: str = ""


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    # "stop" (EOS or a stop string) or "length" (max_tokens or the model's context ran out).
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class InputError(ValueError):
    """The request cannot run on this model (image count != placeholders, prompt longer than context...).

    Never retried; the message is shown to the user.
    """


class Aborted(RuntimeError):
    """The backend dropped the request because the worker asked it to (`Generator.abort`): the job was cancelled,
    or its lease lost, so nobody waits for its result. Not an error of the job's."""


def cut_at_stop_strings(
    tokens: list[int], decode: Callable[[list[int]], str], stops: list[str]
) -> tuple[list[int], str, bool]:
    """(tokens, text, stopped): the tokens up to the one that completes the first stop string and the text
    before that string; unchanged (stopped False) when no stop string occurs."""
    text = decode(tokens)
    if not stops or not any(s in text for s in stops):
        return tokens, text, False
    for k in range(1, len(tokens) + 1):
        prefix = decode(tokens[:k])
        hits = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if hits:
            return tokens[:k], prefix[: min(hits)], True
    return tokens, text, False
