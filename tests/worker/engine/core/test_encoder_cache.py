"""EncoderCache: reservation, LRU eviction of unreferenced entries, references, counters, freed hashes."""

from __future__ import annotations

import pytest

from worker.engine.core.encoder_cache import EncoderCache


def test_allocate_mark_encoded_and_accounting() -> None:
    cache = EncoderCache(capacity_tokens=10)
    assert not cache.contains("a")
    assert cache.allocate("a", 4) == []
    assert cache.contains("a") and cache.num_used_tokens == 4
    assert not cache.is_encoded("a")  # reserved, its step has not run yet
    cache.mark_encoded("a")
    assert cache.is_encoded("a")
    cache.mark_encoded("gone")  # a no-op: its request was aborted while the step ran
    assert (cache.num_misses, cache.num_hits, cache.num_evictions) == (1, 0, 0)
    with pytest.raises(KeyError):
        cache.allocate("a", 4)
    assert cache.can_allocate(6) and cache.can_allocate(10)  # "a" is unreferenced, so evictable
    assert not cache.can_allocate(11)


def test_lru_eviction_of_unreferenced_entries() -> None:
    cache = EncoderCache(capacity_tokens=10)
    for h in ("a", "b"):
        cache.allocate(h, 4)
        cache.mark_encoded(h)
    cache.add_ref("a", "r1")  # "b" is now the least recently used
    cache.remove_ref("a", "r1")
    assert cache.allocate("c", 4) == ["b"]
    assert not cache.contains("b") and cache.contains("a") and cache.contains("c")
    assert cache.num_used_tokens == 8 and cache.num_evictions == 1
    assert cache.allocate("d", 10) == ["a", "c"]
    assert len(cache) == 1 and cache.num_used_tokens == 10 and cache.num_evictions == 3
    assert cache.take_freed() == ["b", "a", "c"]  # for the runner, which holds the embeddings
    assert cache.take_freed() == []


def test_references_prevent_eviction() -> None:
    cache = EncoderCache(capacity_tokens=10)
    cache.allocate("a", 4)
    cache.add_ref("a", "r1")
    cache.allocate("b", 4)
    cache.add_ref("b", "r2")
    cache.mark_encoded("a")
    cache.mark_encoded("b")
    assert cache.num_evictable_tokens == 0
    assert cache.can_allocate(2) and not cache.can_allocate(3)
    with pytest.raises(RuntimeError):
        cache.allocate("c", 3)
    cache.remove_ref("b", "r2")
    assert cache.num_refs("b") == 0 and cache.num_evictable_tokens == 4
    assert cache.allocate("c", 6) == ["b"]
    assert cache.contains("a") and cache.num_refs("a") == 1


def test_release_drops_every_reference_of_a_request() -> None:
    cache = EncoderCache(capacity_tokens=20)
    for h in ("a", "b", "c"):
        cache.allocate(h, 4)
        cache.mark_encoded(h)
    cache.add_ref("a", "r1")
    cache.add_ref("b", "r1")
    cache.add_ref("b", "r2")
    cache.release("r1")
    assert (cache.num_refs("a"), cache.num_refs("b"), cache.num_refs("c")) == (0, 1, 0)
    cache.release("r1")  # idempotent
    cache.release("unknown")
    cache.release("r2")
    assert cache.num_evictable_tokens == 12


def test_hits_and_misses() -> None:
    cache = EncoderCache(capacity_tokens=20)
    cache.allocate("a", 4)      # a miss: r1 makes it get encoded
    cache.add_ref("a", "r1")
    cache.add_ref("a", "r2")    # same step, another request: shares the encode
    assert (cache.num_misses, cache.num_hits) == (1, 1)
    cache.mark_encoded("a")
    cache.release("r1")
    cache.release("r2")
    cache.add_ref("a", "r3")    # a later step: already encoded
    assert (cache.num_misses, cache.num_hits) == (1, 2)


def test_a_reservation_never_filled_is_dropped_with_its_last_reference() -> None:
    """Its step failed (or its request was aborted) before it was marked encoded: a later request must encode
    the image again, not find an empty entry, and the runner must drop whatever it may have stored."""
    cache = EncoderCache(capacity_tokens=10)
    cache.allocate("a", 4)
    cache.add_ref("a", "r1")
    cache.add_ref("a", "r2")
    cache.release("r1")
    assert cache.contains("a")  # r2 still waits for it
    cache.release("r2")
    assert not cache.contains("a") and cache.num_used_tokens == 0
    assert cache.take_freed() == ["a"]
