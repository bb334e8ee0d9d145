"""A model that answers at once, for measuring the queue around the engine (bench/queue_ceiling.py).

Every request is still prepared as the engine would prepare it (chat template, tokenizer, image processor) from
the checkpoint's processor and config, without its weights; then, instead of generating, it answers a fixed
short text. What a worker spends per job on top of this is the queue's own cost, the cost that remains when a
GPU makes the model itself nearly free. It takes the paged engine's inputs from anywhere, as the engine does, so
a worker with VLMQ_PREPARE_PROCESSES prepares image jobs in those processes here too.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from worker.inference.generation import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from worker.engine.model_runner import PreparedInput

ANSWER = "ok"


class NullGenerator:
    takes_engine_inputs: Literal[True] = True

    def __init__(self, loaded: Any) -> None:
        from worker.engine.families import get_family

        self.loaded = loaded
        self.family = get_family(loaded.model)
        # HF fast tokenizers raise "Already borrowed" when one is used from two threads at once.
        self._prepare_lock = threading.Lock()

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        from worker.engine.model_runner import prepare_input, without_decoded_images

        with self._prepare_lock:
            return without_decoded_images(prepare_input(self.loaded, self.family, req))

    def submit(self, prepared: PreparedInput) -> Future[GenerationResult]:
        future: Future[GenerationResult] = Future()
        future.set_result(GenerationResult(prepared.request.request_id, ANSWER, [], "stop",
                                           len(prepared.prompt_token_ids), 1))
        return future

    def abort(self, request_id: str) -> None:
        pass

    def close(self, timeout: float = 10.0) -> None:
        pass
