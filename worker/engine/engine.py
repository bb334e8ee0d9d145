"""The engine: schedule -> run -> postprocess, one step at a time. Glue only; no Celery, HTTP or SQL.

The runner hears of requests only through each step's SchedulerOutput: a request added here reaches it with
its first schedule, and one that finishes or is aborted, with the next schedule's `finished_ids`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from worker.engine.allocator import keep_freed_memory
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.config import EngineConfig
from worker.engine.core.encoder_cache import EncoderCache
from worker.engine.core.request import Request, RequestStatus
from worker.engine.core.scheduler import Scheduler
from worker.engine.families import attention_window
from worker.engine.model_runner import ModelRunner, PreparedInput, num_kv_blocks_for
from worker.engine.request_state import PromptTensors
from worker.inference.generation import GenerationRequest, GenerationResult, cut_at_stop_strings
from worker.inference.model_loader import LoadedModel


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    num_finished: int = 0
    # Wall time of the steps that computed prompt tokens, and of those that only decoded: what a step costs
    # against the same work alone shows how much the processes beside the engine slow it.
    prefill_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def generated_tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self.started_at
        return self.num_generated_tokens / elapsed if elapsed > 0 else 0.0


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        keep_freed_memory()
        self.loaded = loaded
        # Prompt + output stay within the positions the model has, and within its sliding window, if any.
        limits = [n for n in (loaded.max_positions, attention_window(loaded.model.config.get_text_config()))
                  if n is not None]
        self.max_model_len = min(limits) if limits else None
        num_blocks = num_kv_blocks_for(loaded.model, self.config, loaded.device, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.encoder_cache = EncoderCache(self.config.encoder_cache_tokens)
        self.scheduler = Scheduler(self.config, self.block_manager, self.encoder_cache)
        self.runner = ModelRunner(loaded, self.config, num_blocks)
        # Its own tokenizer copy: the caller's threads use the processor's one in prepare().
        self._decoder = copy.deepcopy(loaded.tokenizer)
        self._eos = frozenset(loaded.eos_token_ids)
        self.stats = EngineStats()

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        """Template, tokenise and preprocess images (CPU); safe to call from any thread."""
        return self.runner.prepare(req)

    def add_request(self, prepared: PreparedInput) -> None:
        """Queue a prepared request; raises InputError for one that could never run on this engine."""
        req = prepared.request
        self.scheduler.add_request(Request(
            request_id=req.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=req.sampling,
            images=prepared.images,
            priority=req.priority,
            eos_token_ids=self._eos,
            max_model_len=self.max_model_len,
            cache_salt=req.cache_salt,
            model_inputs=PromptTensors(prepared.image_inputs, prepared.mrope_positions, prepared.mrope_delta),
        ))

    def abort(self, request_id: str) -> bool:
        aborted = self.scheduler.abort(request_id)
        self._flush_if_idle()
        return aborted

    def _flush_if_idle(self) -> None:
        """Nothing steps an idle engine, so tell the runner now of the requests that ended, rather than let it
        hold their tensors until the next request arrives (vLLM steps once more for the same reason)."""
        if not self.scheduler.has_unfinished() and self.scheduler.has_finished():
            self.runner.execute(self.scheduler.schedule())

    def metrics(self) -> dict[str, float]:
        """Counters for dashboards (Prometheus in the worker): load, KV use, caches, vision batches, speed."""
        bm, ec, runner = self.block_manager, self.encoder_cache, self.runner
        return {
            "requests_running": self.scheduler.num_running,
            "requests_waiting": self.scheduler.num_waiting,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_query_tokens": bm.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
            "encoder_cache_hits": ec.num_hits,
            "encoder_cache_misses": ec.num_misses,
            "vision_forwards": runner.num_vision_forwards,
            "vision_images": runner.num_vision_images,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.stats.num_steps,
            "prefill_step_seconds": self.stats.prefill_step_seconds,
            "decode_step_seconds": self.stats.decode_step_seconds,
            "generated_tokens": self.stats.num_generated_tokens,
            "generated_tokens_per_s": self.stats.generated_tokens_per_s,
        }

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[GenerationResult]:
        """One scheduling step; returns the requests that finished in it."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        sampled = self.runner.execute(out)
        elapsed = time.perf_counter() - started
        if sum(s.num_tokens for s in out.scheduled) > len(out.scheduled):  # a decode is one token a request
            self.stats.prefill_step_seconds += elapsed
        else:
            self.stats.decode_step_seconds += elapsed
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(sampled)
        self.stats.num_prompt_tokens_computed += sum(s.num_tokens for s in out.scheduled if not s.samples)
        stopped: list[Request] = []  # by a stop string, in batch order
        for s in out.scheduled:
            token = sampled.get(s.request_id)
            req = self.scheduler.get(s.request_id)
            if token is not None and req is not None and req.sampling.stop and token not in self._eos:
                hit = self._stop_string_hit(req, token)
                if hit is not None:
                    req.stop_reason = hit
                    stopped.append(req)
        finished = self.scheduler.update(out, sampled)
        for req in stopped:
            if not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, req.stop_reason)
                finished.append(req)
        results = [self._result(req) for req in finished if req.status != RequestStatus.FINISHED_ABORTED]
        self.stats.num_finished += len(results)
        self._flush_if_idle()
        return results

    def _stop_string_hit(self, req: Request, token: int) -> str | None:
        # Byte-level tokens can carry a single byte, so a stop string spans at most its UTF-8 length in tokens.
        window = max(len(s.encode()) for s in req.sampling.stop) + 4
        tail = [*req.output_token_ids[-window:], token]
        text = self._decoder.decode(tail, skip_special_tokens=True)
        return next((s for s in req.sampling.stop if s in text), None)

    def _result(self, req: Request) -> GenerationResult:
        tokens, text, stopped = cut_at_stop_strings(
            list(req.output_token_ids), lambda t: self._decoder.decode(t, skip_special_tokens=True),
            req.sampling.stop,
        )
        finish_reason = "stop" if stopped or req.status != RequestStatus.FINISHED_LENGTH else "length"
        return GenerationResult(
            request_id=req.request_id, text=text, token_ids=tokens, finish_reason=finish_reason,
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(tokens),
        )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run a list of requests to completion (offline use, tests and benchmarks)."""
        for req in requests:
            self.add_request(self.prepare(req))
        results: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for result in self.step():
                results[result.request_id] = result
        return [results[r.request_id] for r in requests]
