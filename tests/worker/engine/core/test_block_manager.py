"""BlockManager: accounting, prefix sharing by chained hashes (images included), rounding, free-list policy."""

from __future__ import annotations

import pytest

from worker.engine.core.block_manager import BlockManager
from worker.engine.core.request import ImageItem, Request
from worker.inference.generation import SamplingParams

IMAGE_TOKEN = 9  # every image placeholder position carries this id


def make_request(request_id: str, token_ids: list[int] | None = None, *, num_tokens: int = 8,
                 images: tuple[tuple[str, int, int], ...] = (), max_tokens: int = 4, priority: int = 0,
                 eos: tuple[int, ...] = (), max_model_len: int | None = None, cache_salt: str = "") -> Request:
    """A request with text ids 100, 101, ... (or token_ids); images are (content_hash, offset, num_tokens)."""
    tokens = list(token_ids) if token_ids is not None else [100 + i for i in range(num_tokens)]
    items = [ImageItem(h, offset, n) for h, offset, n in images]
    for item in items:
        tokens[item.offset:item.end] = [IMAGE_TOKEN] * item.num_tokens
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), images=items, priority=priority,
                   eos_token_ids=frozenset(eos), max_model_len=max_model_len, cache_salt=cache_salt)


def compute_all(bm: BlockManager, req: Request) -> None:
    """What a step does for req's whole known sequence: KV written, full blocks registered."""
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed_blocks(req)


def test_allocate_append_free_accounting() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    req = make_request("a", num_tokens=10)
    assert bm.can_allocate(req)
    bm.allocate(req)
    assert len(req.block_ids) == 3 and len(set(req.block_ids)) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks) == (7, 3)
    assert (req.num_computed_tokens, req.num_cached_tokens) == (0, 0)
    assert all(bm.blocks[b].ref_count == 1 for b in req.block_ids)

    req.num_computed_tokens = 10
    req.output_token_ids += [1, 2]  # 12 tokens: position 11 still fits block 2
    assert bm.can_append(req, 2)
    bm.append(req, 2)
    assert len(req.block_ids) == 3
    req.output_token_ids.append(3)  # position 12 needs a fourth block
    req.num_computed_tokens = 12
    bm.append(req, 1)
    assert len(req.block_ids) == 4 and bm.num_free_blocks == 6

    with pytest.raises(RuntimeError):
        bm.allocate(req)  # already holds blocks
    bm.free(req)
    assert req.block_ids == []
    assert (bm.num_free_blocks, bm.num_used_blocks) == (10, 0)
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_can_allocate_and_can_append_respect_the_pool() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    big = make_request("big", num_tokens=13)  # 4 blocks
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError):
        bm.allocate(big)
    req = make_request("a", num_tokens=12)
    bm.allocate(req)
    req.num_computed_tokens = 12
    assert bm.num_free_blocks == 0
    assert bm.can_append(req, 0)
    assert not bm.can_append(req, 1)
    with pytest.raises(RuntimeError):
        bm.append(req, 1)


def test_common_system_prompt_shares_blocks_and_counts_hits() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    system = list(range(200, 212))  # 3 full blocks
    a = make_request("a", [*system, 1, 2, 3])
    b = make_request("b", [*system, 4, 5, 6])
    bm.allocate(a)
    assert a.num_cached_tokens == 0
    compute_all(bm, a)
    assert bm.cached_prefix_tokens(b) == 12
    bm.allocate(b)
    assert b.block_ids[:3] == a.block_ids[:3]
    assert b.block_ids[3] != a.block_ids[3]
    assert [bm.blocks[i].ref_count for i in a.block_ids] == [2, 2, 2, 1]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (12, 12)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (30, 12)
    assert bm.num_used_blocks == 5

    shared = a.block_ids[:3]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 10
    # Freed cached blocks stay findable until reused.
    c = make_request("c", [*system, 7])
    bm.allocate(c)
    assert c.num_computed_tokens == 12 and c.block_ids[:3] == shared
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (43, 24)


def test_requests_share_blocks_only_under_the_same_salt() -> None:
    """Each tenant's jobs carry its own salt: a prefix another tenant computed is not found, so no tenant can
    tell by its own job's speed that another sent the same prompt."""
    bm = BlockManager(num_blocks=20, block_size=4)
    system = list(range(200, 212))  # 3 full blocks
    alice = make_request("alice", [*system, 1], cache_salt="alice")
    bm.allocate(alice)
    compute_all(bm, alice)
    mallory = make_request("mallory", [*system, 1], cache_salt="mallory")
    assert bm.cached_prefix_tokens(mallory) == 0
    bm.allocate(mallory)
    assert mallory.num_cached_tokens == 0 and not set(mallory.block_ids) & set(alice.block_ids)
    again = make_request("alice-again", [*system, 2], cache_salt="alice")
    assert bm.cached_prefix_tokens(again) == 12


def test_different_images_with_identical_token_ids_do_not_share() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    cat = make_request("cat", num_tokens=14, images=(("cat", 4, 6),))
    dog = make_request("dog", num_tokens=14, images=(("dog", 4, 6),))
    assert cat.prompt_token_ids == dog.prompt_token_ids
    bm.allocate(cat)
    compute_all(bm, cat)
    # Only block 0 (text before the image) matches.
    bm.allocate(dog)
    assert dog.num_computed_tokens == 4
    assert dog.block_ids[0] == cat.block_ids[0] and dog.block_ids[1] != cat.block_ids[1]
    # Same image at the same place with the same text: full reuse of the 3 full blocks.
    cat2 = make_request("cat2", num_tokens=14, images=(("cat", 4, 6),))
    bm.allocate(cat2)
    assert cat2.num_computed_tokens == 12 and cat2.block_ids[:3] == cat.block_ids[:3]
    # Same image one position later: the placement differs from block 1 on.
    shifted = make_request("shifted", num_tokens=14, images=(("cat", 5, 6),))
    assert bm.cached_prefix_tokens(shifted) == 4


def test_prefix_hit_ending_inside_an_image_rounds_down_to_the_image_start() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_request("a", num_tokens=20, images=(("img", 8, 6),))  # image at [8, 14)
    bm.allocate(a)
    compute_all(bm, a)
    tokens = list(a.prompt_token_ids)
    tokens[14] = 555  # differs right after the image, inside block 3: blocks 0-2 (12 tokens) match
    b = make_request("b", tokens, images=(("img", 8, 6),))
    bm.allocate(b)
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)  # 12 is inside [8, 14): back to 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.blocks[a.block_ids[2]].ref_count == 1
    assert bm.num_prefix_hit_tokens == 8


def test_image_start_inside_a_block_rounds_down_to_the_block_start() -> None:
    # Recomputing from the image offset would write into a block other requests share: start at its block instead.
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_request("a", num_tokens=20, images=(("img", 6, 8),))  # [6, 14)
    bm.allocate(a)
    compute_all(bm, a)
    tokens = list(a.prompt_token_ids)
    tokens[14] = 555
    b = make_request("b", tokens, images=(("img", 6, 8),))
    assert bm.cached_prefix_tokens(b) == 4


def test_last_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", num_tokens=12)
    bm.allocate(a)
    compute_all(bm, a)
    same = make_request("same", num_tokens=12)  # fully cached, but the step needs the last token's logits
    bm.allocate(same)
    assert same.num_computed_tokens == 8
    assert same.block_ids[:2] == a.block_ids[:2] and same.block_ids[2] != a.block_ids[2]
    longer = make_request("longer", num_tokens=13)
    assert bm.cached_prefix_tokens(longer) == 12


def test_only_full_computed_blocks_are_registered() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", num_tokens=10)
    bm.allocate(a)
    a.num_computed_tokens = 7  # one full computed block; block 1 is half computed
    bm.cache_computed_blocks(a)
    assert bm.cached_prefix_tokens(make_request("b", num_tokens=10)) == 4
    a.num_computed_tokens = 10
    bm.cache_computed_blocks(a)
    assert bm.cached_prefix_tokens(make_request("c", num_tokens=10)) == 8  # block 2 holds only 2 tokens


def test_free_list_reuses_uncached_blocks_first_then_evicts_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", num_tokens=8)
    bm.allocate(a)
    compute_all(bm, a)
    head, tail = a.block_ids
    bm.free(a)
    c = make_request("c", list(range(300, 304)))
    bm.allocate(c)
    assert c.block_ids[0] not in (head, tail)  # a never-used block goes first
    assert bm.cached_prefix_tokens(make_request("a2", num_tokens=9)) == 8
    d = make_request("d", list(range(400, 408)))
    bm.allocate(d)
    assert tail in d.block_ids and head not in d.block_ids  # a's tail was freed first, so it is evicted first
    assert bm.cached_prefix_tokens(make_request("a3", num_tokens=9)) == 4
    assert bm.blocks[tail].block_hash is None


def test_free_uncomputed_block_goes_to_the_front() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request("a", num_tokens=8)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_request("b", list(range(500, 504)))
    bm.allocate(b)  # never computed, so never hashed
    a_blocks, b_blocks = a.block_ids, b.block_ids
    bm.free(a)
    bm.free(b)
    c = make_request("c", list(range(600, 604)))
    bm.allocate(c)
    assert c.block_ids == b_blocks and c.block_ids[0] not in a_blocks
    assert bm.cached_prefix_tokens(make_request("a2", num_tokens=9)) == 8


def test_disabled_prefix_caching_never_shares() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request("a", num_tokens=12)
    bm.allocate(a)
    compute_all(bm, a)
    b = make_request("b", num_tokens=13)
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_ids) & set(b.block_ids)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (0, 0)


def test_reclaiming_a_free_cached_block_counts_against_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request("a", num_tokens=8)
    bm.allocate(a)
    compute_all(bm, a)
    cached = a.block_ids
    bm.free(a)
    other = make_request("other", list(range(700, 704)))
    bm.allocate(other)
    # b hits both of a's free cached blocks and needs one more: 3 free-list blocks, only 2 free.
    b = make_request("b", num_tokens=9)
    assert bm.cached_prefix_tokens(b) == 8
    assert not bm.can_allocate(b)
    bm.free(other)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_ids[:2] == cached and bm.num_free_blocks == 0
