"""Scheduler: budgets, chunked prefill, images, priorities, preemption, aborts; a randomized simulation.

A small harness plays the model runner from the SchedulerOutput alone, as the real one must: it keeps its own
token ids, block table and images per request and its own set of encoded hashes, stores a fake embedding for
every EncoderInput, writes a fake KV entry (position, token id, image and row) into each computed slot, and
before each step checks that its state equals the scheduler's and that every position the step treats as
already computed holds exactly the entry this request would have written, so prefix-cache reuse, preemption
and the contract itself are checked end to end.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.worker.engine.core.test_block_manager import IMAGE_TOKEN, make_request
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.config import EngineConfig
from worker.engine.core.encoder_cache import EncoderCache
from worker.engine.core.request import Request, RequestStatus
from worker.engine.core.scheduler import Scheduler
from worker.engine.core.scheduler_output import SchedulerOutput
from worker.inference.generation import InputError


def next_token(req: Request) -> int:
    return 50 + len(req.output_token_ids)


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, **config: Any) -> None:
        self.config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **config)
        self.bm = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        self.cache = EncoderCache(self.config.encoder_cache_tokens)
        self.sched = Scheduler(self.config, self.bm, self.cache)
        self.kv: dict[tuple[int, int], tuple[int, int, tuple[str, int] | None]] = {}
        self.finished: list[Request] = []
        # The runner's side: what it knows of each request, and the hashes whose embeddings it holds.
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.embeddings: set[str] = set()

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.sched.add_request(req)

    def step(self, token: Callable[[Request], int] = next_token) -> SchedulerOutput:
        out = self.sched.schedule()
        self.follow(out)
        self.check(out)
        for e in out.encoder_inputs:
            assert e.content_hash not in self.embeddings, "an image encoded twice"
            self.embeddings.add(e.content_hash)
        for s in out.scheduled:
            req = self.request(s.request_id)
            for pos in range(s.start, s.start + s.num_tokens):
                self.kv[self.slot(req, pos)] = self.expected_kv(req, pos)
        sampled = {s.request_id: token(self.request(s.request_id)) for s in out.scheduled if s.samples}
        for request_id, token_id in sampled.items():
            self.tokens[request_id].append(token_id)
        self.finished += self.sched.update(out, sampled)
        self.check_blocks()
        return out

    def follow(self, out: SchedulerOutput) -> None:
        """What the model runner does with the output before computing anything."""
        for request_id in out.finished_ids:
            self.tokens.pop(request_id, None)
            self.tables.pop(request_id, None)
        self.embeddings.difference_update(out.freed_encoder_hashes)
        for request_id in out.preempted_ids:
            self.tables[request_id].clear()
        for new in out.new_requests:
            assert new.request_id not in self.tokens, "a request handed to the runner twice"
            self.tokens[new.request_id] = list(new.prompt_token_ids)
            self.tables[new.request_id] = []
        for s in out.scheduled:
            self.tables[s.request_id].extend(s.new_block_ids)

    def request(self, request_id: str) -> Request:
        req = self.sched.get(request_id)
        assert req is not None, f"{request_id} is scheduled but not unfinished"
        return req

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs: list[SchedulerOutput] = []
        while self.sched.has_unfinished():
            assert len(outputs) < max_steps, "the scheduler stopped making progress"
            outputs.append(self.step())
        return outputs

    def slot(self, req: Request, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.bm.block_size], pos % self.bm.block_size

    @staticmethod
    def expected_kv(req: Request, pos: int) -> tuple[int, int, tuple[str, int] | None]:
        image = next((im for im in req.images if im.offset <= pos < im.end), None)
        return pos, req.all_token_ids[pos], (image.content_hash, pos - image.offset) if image else None

    def check(self, out: SchedulerOutput) -> None:
        cfg = self.config
        over_budget_image = len(out.scheduled) == 1 and any(
            im.offset == out.scheduled[0].start and im.num_tokens == out.scheduled[0].num_tokens
            for im in self.request(out.scheduled[0].request_id).images)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens or over_budget_image
        assert self.sched.num_running <= cfg.max_num_seqs
        hashes = [e.content_hash for e in out.encoder_inputs]
        assert len(hashes) == len(set(hashes)) <= cfg.max_encoder_items_per_step
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            req, end = self.request(s.request_id), s.start + s.num_tokens
            assert req.status == RequestStatus.RUNNING and s.start == req.num_computed_tokens
            # The runner's own copy, built from outputs alone, is the scheduler's.
            assert self.tokens[s.request_id] == req.all_token_ids and self.tables[s.request_id] == req.block_ids
            assert s.num_tokens >= 1 and end <= req.num_tokens and s.samples == (end == req.num_tokens)
            assert len(req.block_ids) * self.bm.block_size >= end
            for im in req.images_in(s.start, end):
                assert s.start <= im.offset and im.end <= end, "a chunk split an image"
                assert self.cache.num_refs(im.content_hash) >= 1
                assert im.content_hash in self.embeddings or im.content_hash in hashes, "no embedding for an image"
            for pos in range(s.start):
                assert self.kv.get(self.slot(req, pos)) == self.expected_kv(req, pos), "reused KV is wrong"
            for pos in range(s.start, end):
                assert self.bm.blocks[req.block_ids[pos // self.bm.block_size]].ref_count == 1, "shared block written"
        for request_id in out.preempted_ids:
            req = self.request(request_id)
            assert req.status == RequestStatus.WAITING and req.block_ids == [] and req.num_computed_tokens == 0

    def check_blocks(self) -> None:
        owners = Counter(b for req in self.sched.running for b in req.block_ids)
        assert all(len(set(req.block_ids)) == len(req.block_ids) for req in self.sched.running)
        assert all(req.block_ids == [] for req in self.sched.waiting)
        assert all(block.ref_count == owners[block.block_id] for block in self.bm.blocks)
        assert self.bm.num_free_blocks == sum(1 for block in self.bm.blocks if block.ref_count == 0)
        # Chunks end on image boundaries, so no embedding stays referenced between steps.
        assert self.cache.num_evictable_tokens == self.cache.num_used_tokens

    def assert_all_free(self) -> None:
        assert not self.sched.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.cache.num_evictable_tokens == self.cache.num_used_tokens


def batch(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled]


def test_decodes_and_prefill_chunks_share_the_token_budget() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add(*(make_request(r, [1000 * i + j for j in range(10)], max_tokens=3) for i, r in enumerate("abc")))
    assert batch(h.step()) == [("a", 0, 10, True), ("b", 0, 6, False)]
    assert batch(h.step()) == [("a", 10, 1, True), ("b", 6, 4, True), ("c", 0, 10, True)]
    assert batch(h.step()) == [("a", 11, 1, True), ("b", 10, 1, True), ("c", 10, 1, True)]
    assert [r.request_id for r in h.finished] == ["a"]
    h.run()
    assert all(r.output_token_ids == [50, 51, 52] and r.status == RequestStatus.FINISHED_LENGTH for r in h.finished)
    h.assert_all_free()


def test_long_prompt_is_prefilled_in_chunks() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add(make_request("long", num_tokens=40, max_tokens=2))
    outputs = h.run()
    assert [batch(o) for o in outputs] == [
        [("long", 0, 16, False)], [("long", 16, 16, False)], [("long", 32, 8, True)], [("long", 40, 1, True)]]
    assert h.finished[0].output_token_ids == [50, 51]
    h.assert_all_free()


def test_a_chunk_never_splits_an_image() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add(make_request("r", num_tokens=30, images=(("cat", 10, 12),), max_tokens=1))
    outputs = h.run()
    assert [batch(o) for o in outputs] == [[("r", 0, 10, False)], [("r", 10, 16, False)], [("r", 26, 4, True)]]
    assert [[e.content_hash for e in o.encoder_inputs] for o in outputs] == [[], ["cat"], []]
    h.assert_all_free()


def test_an_image_larger_than_the_budget_runs_alone_over_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("a", num_tokens=4, max_tokens=3))
    h.add(make_request("big", num_tokens=14, images=(("huge", 0, 12),), max_tokens=1))
    assert batch(h.step()) == [("a", 0, 4, True)]  # "big" would split its image: it waits
    assert batch(h.step()) == [("a", 4, 1, True)]  # not first in the step: still waits
    assert batch(h.step()) == [("a", 5, 1, True)]
    assert batch(h.step()) == [("big", 0, 12, False)]  # first in the step now
    assert batch(h.step()) == [("big", 12, 2, True)]
    h.assert_all_free()


def test_encoder_budget_pushes_images_to_later_steps() -> None:
    h = Harness(max_num_batched_tokens=64, max_encoder_items_per_step=1)
    h.add(make_request("r", num_tokens=20, images=(("i0", 2, 2), ("i1", 6, 2), ("i2", 10, 2)), max_tokens=1))
    outputs = h.run()
    assert [batch(o) for o in outputs] == [[("r", 0, 6, False)], [("r", 6, 4, False)], [("r", 10, 10, True)]]
    assert [[e.content_hash for e in o.encoder_inputs] for o in outputs] == [["i0"], ["i1"], ["i2"]]
    assert (h.cache.num_misses, h.cache.num_hits) == (3, 0)


def test_encoder_cache_space_pushes_images_to_later_steps() -> None:
    h = Harness(max_num_batched_tokens=64, encoder_cache_tokens=6)
    h.add(make_request("r", num_tokens=20, images=(("i0", 0, 4), ("i1", 8, 4)), max_tokens=1))
    outputs = h.run()
    assert [batch(o) for o in outputs] == [[("r", 0, 8, False)], [("r", 8, 12, True)]]
    assert [o.freed_encoder_hashes for o in outputs] == [[], ["i0"]]
    assert h.cache.num_evictions == 1


def test_one_encoder_input_per_distinct_image_per_step() -> None:
    h = Harness(max_num_batched_tokens=64)
    h.add(make_request("a", num_tokens=8, images=(("cat", 0, 4),), max_tokens=1),
          make_request("b", [200 + i for i in range(10)], images=(("cat", 2, 4), ("dog", 6, 2)), max_tokens=1))
    out = h.step()
    assert [(e.request_id, e.image_index, e.content_hash) for e in out.encoder_inputs] == [
        ("a", 0, "cat"), ("b", 1, "dog")]
    assert (h.cache.num_misses, h.cache.num_hits) == (2, 1)
    h.add(make_request("c", [300 + i for i in range(6)], images=(("cat", 1, 4),), max_tokens=1))
    out = h.step()
    assert batch(out) == [("c", 0, 6, True)] and out.encoder_inputs == []
    assert (h.cache.num_misses, h.cache.num_hits) == (2, 2)


def test_prefix_cache_skips_the_shared_system_prompt() -> None:
    h = Harness(max_num_batched_tokens=64)
    system = [200 + i for i in range(12)]
    h.add(make_request("a", [*system, 1, 2], images=(("cat", 4, 4),), max_tokens=1))
    h.run()
    h.add(make_request("b", [*system, 3, 4, 5], images=(("cat", 4, 4),), max_tokens=1))
    out = h.step()
    assert batch(out) == [("b", 12, 3, True)] and out.encoder_inputs == []
    assert h.finished[-1].num_cached_tokens == 12
    assert (h.bm.num_prefix_query_tokens, h.bm.num_prefix_hit_tokens) == (14 + 15, 12)


def test_waiting_requests_are_admitted_in_priority_order() -> None:
    h = Harness(max_num_seqs=1)
    h.add(make_request("low", num_tokens=4, max_tokens=1, priority=0),
          make_request("old-high", num_tokens=4, max_tokens=1, priority=5),
          make_request("new-high", num_tokens=4, max_tokens=1, priority=5))
    assert [batch(o)[0][0] for o in h.run()] == ["old-high", "new-high", "low"]


def test_a_blocked_head_is_not_overtaken_by_a_lower_priority_request() -> None:
    h = Harness(num_blocks=4, block_size=4)
    h.add(make_request("top", num_tokens=8, max_tokens=4, priority=10))
    h.step()  # "top" holds 2 blocks, 9 tokens
    h.add(make_request("high", [300 + i for i in range(12)], max_tokens=1, priority=5),
          make_request("low", num_tokens=4, max_tokens=1, priority=0))
    assert batch(h.step()) == [("top", 8, 1, True)]  # 3 blocks used: "high" needs 3, "low" would fit but waits
    assert h.sched.num_waiting == 2
    h.run()
    assert [r.request_id for r in h.finished] == ["top", "high", "low"]
    h.assert_all_free()


def test_preemption_evicts_lowest_priority_newest_and_recomputes_it() -> None:
    h = Harness(num_blocks=6, block_size=4)
    h.add(make_request("a", num_tokens=8, max_tokens=8, priority=1),
          make_request("b", [300 + i for i in range(8)], max_tokens=8, priority=1),
          make_request("c", [400 + i for i in range(4)], max_tokens=8, priority=0))
    outputs = h.run()
    preempted = [o.preempted_ids for o in outputs]
    assert preempted[1] == ["c"]  # out of blocks: the lowest priority goes first
    assert [p for p in preempted if p] == [["c"], ["b"]]  # then the newer of the two priority-1 requests
    assert h.sched.num_preemptions == 2
    assert {r.request_id: r.num_preemptions for r in h.finished} == {"a": 0, "b": 1, "c": 1}
    assert all(r.output_token_ids == list(range(50, 58)) for r in h.finished)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in h.finished)
    b = next(r for r in h.finished if r.request_id == "b")
    # Its recompute reused its own registered blocks, except the tail block "a" took over when it grew.
    assert b.num_cached_tokens == 8
    h.assert_all_free()


def test_a_preempted_request_goes_to_the_front_of_its_priority_class() -> None:
    h = Harness(num_blocks=4, block_size=4)
    older = make_request("older", [500 + i for i in range(8)], max_tokens=1)  # arrives before "b", added later
    h.add(make_request("a", num_tokens=8, max_tokens=4, priority=1),
          make_request("b", [300 + i for i in range(4)], max_tokens=4))
    h.step()  # 3 of 4 blocks used
    h.add(older)
    out = h.step()  # "a" takes the last block; "b" needs one more and is the lowest/newest: preempted
    assert batch(out) == [("a", 8, 1, True)] and out.preempted_ids == ["b"]
    assert [r.request_id for r in h.sched.waiting] == ["b", "older"]
    assert h.sched.waiting[0].output_token_ids == [50]
    admitted = [rid for o in h.run() for rid, *_ in batch(o) if rid != "a"]
    assert list(dict.fromkeys(admitted)) == ["b", "older"]
    h.assert_all_free()


def test_abort_during_a_step_is_skipped_by_update() -> None:
    h = Harness()
    r = make_request("r", num_tokens=4, max_tokens=3)
    h.add(r)
    out = h.sched.schedule()
    assert h.sched.abort("r")
    assert h.sched.update(out, {"r": 50}) == []
    assert r.output_token_ids == []
    assert h.sched.schedule().finished_ids == ["r"]
    h.assert_all_free()


def test_abort_frees_everything() -> None:
    h = Harness(num_blocks=8, max_num_batched_tokens=8)
    h.add(make_request("run", num_tokens=8, images=(("cat", 0, 4),), max_tokens=5),
          make_request("wait", num_tokens=8, max_tokens=5))
    h.step()
    assert (h.sched.num_running, h.sched.num_waiting, h.bm.num_used_blocks) == (1, 1, 2)
    assert h.sched.abort("run") and h.sched.abort("wait")
    assert not h.sched.abort("wait") and not h.sched.abort("unknown")
    assert not h.sched.has_unfinished() and h.bm.num_free_blocks == 8
    assert h.cache.num_refs("cat") == 0
    out = h.sched.schedule()
    assert out.finished_ids == ["run", "wait"] and out.is_empty
    assert h.sched.schedule().finished_ids == []


def test_finish_by_the_engine_and_eos() -> None:
    h = Harness()
    stopped = make_request("stop-string", num_tokens=4, max_tokens=9)
    eos = make_request("eos", [100, 101, 102], max_tokens=9, eos=(51,))
    h.add(stopped, eos)
    h.step()
    h.sched.finish(stopped, RequestStatus.FINISHED_STOPPED, "###")
    assert (stopped.status, stopped.stop_reason, stopped.block_ids) == (RequestStatus.FINISHED_STOPPED, "###", [])
    out = h.step()
    assert out.finished_ids == ["stop-string"]
    assert [(r.request_id, r.status, r.output_token_ids) for r in h.finished] == [
        ("eos", RequestStatus.FINISHED_STOPPED, [50, 51])]
    h.assert_all_free()


def test_max_num_seqs_is_respected() -> None:
    h = Harness(max_num_seqs=2)
    h.add(*(make_request(f"r{i}", [100 * i + j for j in range(5)], max_tokens=3) for i in range(5)))
    outputs = h.run()
    assert max(len(o.scheduled) for o in outputs) == 2
    assert len(outputs) == 9 and sorted(r.request_id for r in h.finished) == [f"r{i}" for i in range(5)]
    h.assert_all_free()


def test_requests_that_can_never_fit_do_not_hang() -> None:
    h = Harness(num_blocks=4, block_size=4, encoder_cache_tokens=8)
    with pytest.raises(InputError, match="exceeds the KV cache"):
        h.add(make_request("too-long", num_tokens=17))
    with pytest.raises(InputError, match="exceeds the encoder cache"):
        h.add(make_request("huge-image", num_tokens=12, images=(("x", 0, 9),)))
    with pytest.raises(InputError, match="max_model_len"):
        h.add(make_request("no-room", num_tokens=8, max_model_len=8))
    assert not h.sched.has_unfinished()
    # Prompt fits, but prompt + output outgrow the whole pool: it ends as if out of context.
    h.add(make_request("grows", num_tokens=12, max_tokens=20))
    h.run()
    grows = h.finished[0]
    assert (grows.status, len(grows.output_token_ids)) == (RequestStatus.FINISHED_LENGTH, 5)
    h.assert_all_free()


def test_max_model_len_caps_the_output() -> None:
    h = Harness()
    h.add(make_request("r", num_tokens=6, max_tokens=10, max_model_len=9))
    h.run()
    assert h.finished[0].output_token_ids == [50, 51, 52]


@pytest.mark.parametrize("seed", range(40))
def test_randomized_simulation_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    h = Harness(num_blocks=rng.randint(6, 20), block_size=block_size, max_num_batched_tokens=rng.choice([6, 16, 40]),
                max_num_seqs=rng.randint(1, 6), max_encoder_items_per_step=rng.randint(1, 3),
                encoder_cache_tokens=rng.choice([12, 20, 64]), enable_prefix_caching=rng.random() < 0.8)
    image_sizes = {"img0": 3, "img1": 5, "img2": 8, "img3": 12}
    prefixes = [[rng.randrange(100, 110) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    capacity = h.bm.num_blocks * block_size
    pending: list[Request] = []
    while len(pending) < rng.randint(10, 25):
        tokens, images = list(rng.choice(prefixes)), []
        for _ in range(rng.randint(0, 3)):
            tokens += [rng.randrange(100, 110) for _ in range(rng.randint(0, 5))]
            content_hash = rng.choice(list(image_sizes))
            images.append((content_hash, len(tokens), image_sizes[content_hash]))
            tokens += [IMAGE_TOKEN] * image_sizes[content_hash]
        tokens += [rng.randrange(100, 110) for _ in range(rng.randint(1, 5))]
        max_tokens = rng.randint(1, 8)
        if len(tokens) + max_tokens - 1 <= capacity:  # never outgrows the pool: must finish with max_tokens
            pending.append(make_request(f"r{len(pending)}", tokens, images=tuple(images), max_tokens=max_tokens,
                                        priority=rng.choice([0, 0, 1, 2]), eos=(47,) if rng.random() < 0.2 else ()))
    aborted: set[str] = set()
    for _ in range(3000):
        if not pending and not h.sched.has_unfinished():
            break
        while pending and (rng.random() < 0.3 or not h.sched.has_unfinished()):
            h.add(pending.pop(0))
        if rng.random() < 0.02 and h.sched.has_unfinished():
            victim = rng.choice(h.sched.running + h.sched.waiting)
            assert h.sched.abort(victim.request_id)
            aborted.add(victim.request_id)
        h.step(token=lambda req: rng.choice([47, *range(20, 30)]) if req.eos_token_ids else 20)
    assert not pending and not h.sched.has_unfinished()
    assert len(h.finished) + len(aborted) == len({r.request_id for r in h.finished} | aborted)
    for req in h.finished:
        assert req.request_id not in aborted
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert req.output_token_ids[-1] == 47 and len(req.output_token_ids) <= req.sampling.max_tokens
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert len(req.output_token_ids) == req.sampling.max_tokens
    h.assert_all_free()


def test_engine_bookkeeping_does_not_import_torch() -> None:
    code = ("import sys\nimport worker.engine.core.scheduler, worker.engine.core.block_manager\n"
            "import worker.engine.core.encoder_cache\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4])
