"""Which requests compute which positions each step, under a token budget, KV blocks and an encoder budget. No torch.

In the spirit of vLLM v1: one budget of `max_num_batched_tokens` per step shared by decodes and prefill chunks.
Running requests go first in priority order (higher priority, then older arrival); when KV blocks run out the
lowest-priority, newest running request is preempted by recompute. Waiting requests are then admitted strictly in
priority order: when the head of the queue cannot be admitted (blocks, budget, images) admission stops, so a lower
priority never overtakes a higher one, and a small request also waits behind a big one of its own priority. No
request is admitted in a step that preempted one (memory is tight; vLLM does the same).

Images: a chunk never splits an image's placeholder run, and every image overlapping a chunk has its embedding in
the encoder cache or encoded this step. Chunks always end on image boundaries, so once a step is done its images are
in the KV cache and their encoder-cache references are dropped: between steps no entry is referenced, and an image
that fits the encoder cache can always be encoded as the first item of a step.

Requests that can never fit are refused or finished, never queued forever: `add_request` raises InputError for a
prompt larger than the whole KV pool (or leaving no room in max_model_len) or an image larger than the encoder
cache; a request whose prompt + output outgrows the whole pool ends FINISHED_LENGTH (reported by `update`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from worker.engine.core.block_manager import BlockManager
from worker.engine.core.config import EngineConfig
from worker.engine.core.encoder_cache import EncoderCache
from worker.engine.core.request import Request, RequestStatus
from worker.engine.core.scheduler_output import EncoderInput, NewRequestData, ScheduledRequest, SchedulerOutput
from worker.inference.generation import InputError


@dataclass
class _Step:
    output: SchedulerOutput
    token_budget: int
    num_encoder_items: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, encoder_cache: EncoderCache) -> None:
        self.config = config
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.waiting: list[Request] = []  # in admission order, see _waiting_key
        self.running: list[Request] = []  # by (priority desc, arrival asc): the tail is the next to preempt
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._finished_ids: list[str] = []  # since the last schedule()
        self._outgrown: list[Request] = []  # finished by schedule() itself; update() reports them with the step
        self._front_rank: dict[str, int] = {}  # preempted request id -> rank putting it before its priority class
        self._num_front_ranks = 0
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished(self) -> bool:
        """Requests ended since the last schedule(), which the runner has not been told of yet."""
        return bool(self._finished_ids)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id."""
        return self._requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queue req; raises InputError when it could never run (see the module docstring)."""
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id} is already scheduled")
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        largest_image = max((im.num_tokens for im in req.images), default=0)
        if req.num_prompt_tokens > pool_tokens:
            raise InputError(f"prompt of {req.num_prompt_tokens} tokens exceeds the KV cache ({pool_tokens} tokens)")
        if largest_image > self.encoder_cache.capacity_tokens:
            raise InputError(f"an image of {largest_image} tokens exceeds the encoder cache "
                             f"({self.encoder_cache.capacity_tokens} tokens)")
        if req.max_tokens <= 0:
            raise InputError(f"prompt of {req.num_prompt_tokens} tokens leaves no room to generate within "
                             f"max_model_len={req.max_model_len}")
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._waiting_key)

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED, "aborted")
        return True

    def finish(self, req: Request, status: RequestStatus, stop_reason: str | None = None) -> None:
        """End req (also for stop strings, which the engine detects): frees its blocks and encoder references."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if req.status.finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        if stop_reason is not None:  # keep a stop string the engine noted before update() ended the request
            req.stop_reason = stop_reason
        self.block_manager.free(req)
        self.encoder_cache.release(req.request_id)
        self._requests.pop(req.request_id, None)
        self._front_rank.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    # -- scheduling ------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(SchedulerOutput(finished_ids=self._finished_ids), self.config.max_num_batched_tokens)
        self._finished_ids = []
        self._schedule_running(step)
        if not step.output.preempted_ids:
            self._admit_waiting(step)
        step.output.freed_encoder_hashes = self.encoder_cache.take_freed()
        return step.output

    def _schedule_running(self, step: _Step) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and step.token_budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, step.token_budget)
            if bm.num_blocks_for(req.num_computed_tokens + num_new) > bm.num_blocks:
                self._finish_outgrown(req)
                continue
            while not bm.can_append(req, num_new):
                victim = self.running[-1]  # lowest priority, newest: never one already scheduled this step
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            # Blocks are ensured for num_new; a chunk shortened at an image needs no more than that.
            num_new = self._reserve_chunk(req, req.num_computed_tokens, num_new, step)
            if num_new > 0:
                num_old_blocks = len(req.block_ids)
                bm.append(req, num_new)
                self._add_scheduled(req, num_new, step, req.block_ids[num_old_blocks:])
            i += 1

    def _admit_waiting(self, step: _Step) -> None:
        bm = self.block_manager
        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if bm.num_blocks_for(req.num_tokens) > bm.num_blocks:  # a recomputed request that outgrew the pool
                self._finish_outgrown(req)
                continue
            if not bm.can_allocate(req):
                break
            start = bm.cached_prefix_tokens(req)
            num_new = self._reserve_chunk(req, start, min(req.num_tokens - start, step.token_budget), step)
            if num_new == 0:
                break
            self.waiting.pop(0)
            self._front_rank.pop(req.request_id, None)
            bm.allocate(req)  # takes the same prefix hit: nothing touched the block pool since cached_prefix_tokens
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=self._running_key)
            if req.num_preemptions == 0:  # its first admission (a preempted one was admitted before)
                step.output.new_requests.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, req.sampling, req.images, req.model_inputs))
                req.model_inputs = None  # the runner's from now on
            self._add_scheduled(req, num_new, step, list(req.block_ids))

    def _finish_outgrown(self, req: Request) -> None:
        """Its prompt + output no longer fit the whole KV pool: like running out of context."""
        self.finish(req, RequestStatus.FINISHED_LENGTH)
        self._outgrown.append(req)

    def _add_scheduled(self, req: Request, num_new: int, step: _Step, new_block_ids: list[int]) -> None:
        start = req.num_computed_tokens
        step.output.scheduled.append(ScheduledRequest(
            req.request_id, start, num_new, samples=start + num_new == req.num_tokens, new_block_ids=new_block_ids))
        step.token_budget -= num_new

    def _reserve_chunk(self, req: Request, start: int, max_tokens: int, step: _Step) -> int:
        """Length of req's chunk from `start`: at most max_tokens, ending on an image boundary, every image in it
        with an embedding available (referenced in the encoder cache, or encoded this step). 0: wait a step."""
        end = start + max_tokens
        for index, image in enumerate(req.images):
            if image.end <= start:
                continue
            if image.offset >= end:
                break
            if image.end > end:
                # Never split an image; one that alone exceeds the whole budget goes first in an empty step, over
                # budget, or it could never run.
                too_big = image.num_tokens > self.config.max_num_batched_tokens
                if not (too_big and image.offset <= start and not step.output.scheduled):
                    end = image.offset
                    break
                end = image.end
            if not self._reserve_embedding(req, index, step):
                end = image.offset
                break
        return max(end - start, 0)

    def _reserve_embedding(self, req: Request, image_index: int, step: _Step) -> bool:
        image = req.images[image_index]
        cache = self.encoder_cache
        # An entry exists if it is cached or already being encoded this step: one EncoderInput per hash per step.
        if not cache.contains(image.content_hash):
            if (step.num_encoder_items >= self.config.max_encoder_items_per_step
                    or not cache.can_allocate(image.num_tokens)):
                return False
            cache.allocate(image.content_hash, image.num_tokens)  # evicted hashes go out with take_freed()
            step.output.encoder_inputs.append(EncoderInput(req.request_id, image_index, image.content_hash))
            step.num_encoder_items += 1
        cache.add_ref(image.content_hash, req.request_id)
        return True

    def _preempt(self, req: Request, step: _Step) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        self.encoder_cache.release(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._num_front_ranks += 1
        self._front_rank[req.request_id] = -self._num_front_ranks  # later preemptions go further ahead
        bisect.insort(self.waiting, req, key=self._waiting_key)
        step.output.preempted_ids.append(req.request_id)

    def _waiting_key(self, req: Request) -> tuple[int, int, int]:
        return -req.priority, self._front_rank.get(req.request_id, 0), req.arrival

    @staticmethod
    def _running_key(req: Request) -> tuple[int, int]:
        return -req.priority, req.arrival

    # -- after the step --------------------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the requests the runner just computed; returns those that finished in this step (including any
        that schedule() ended for outgrowing the KV pool). Stop strings are the engine's: it calls finish()."""
        finished, self._outgrown = self._outgrown, []
        # First, or dropping the last reference to an image encoded this step would take it for a failed one.
        for encoded in output.encoder_inputs:
            self.encoder_cache.mark_encoded(encoded.content_hash)
        for scheduled in output.scheduled:
            req = self._requests.get(scheduled.request_id)
            if req is None or req.status != RequestStatus.RUNNING:  # aborted while the step ran
                continue
            req.num_computed_tokens += scheduled.num_tokens
            # The images of this chunk are in the KV cache now; their embeddings may be evicted.
            for image in req.images_in(scheduled.start, scheduled.start + scheduled.num_tokens):
                self.encoder_cache.remove_ref(image.content_hash, req.request_id)
            self.block_manager.cache_computed_blocks(req)
            if not scheduled.samples:
                continue
            token_id = sampled[req.request_id]
            req.output_token_ids.append(token_id)
            if token_id in req.eos_token_ids:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif len(req.output_token_ids) >= req.max_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
            else:
                continue
            finished.append(req)
        return finished
