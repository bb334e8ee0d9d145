"""What the model runner keeps per request, built from the SchedulerOutput alone (core/scheduler_output.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.core.request import ImageItem
from worker.engine.core.scheduler_output import NewRequestData
from worker.inference.generation import SamplingParams


@dataclass
class PromptTensors:
    """What the runner needs of a prompt besides its token ids; travels opaque in `NewRequestData.model_inputs`."""

    image_inputs: list[dict[str, torch.Tensor]]  # per image, what the vision tower takes
    mrope_positions: torch.Tensor | None  # [3, prompt_len] for M-RoPE families
    mrope_delta: int


@dataclass
class RequestState:
    """The runner's own copy of a request, from its first schedule until the output names it finished."""

    token_ids: list[int]  # the prompt, then each token the runner sampled for it
    sampling: SamplingParams
    images: list[ImageItem]
    tensors: PromptTensors
    block_ids: list[int] = field(default_factory=list)  # emptied on preemption, refilled on admission

    @classmethod
    def of(cls, new: NewRequestData) -> RequestState:
        assert isinstance(new.model_inputs, PromptTensors)  # what Engine.add_request gave the scheduler
        return cls(list(new.prompt_token_ids), new.sampling, new.images, new.model_inputs)
