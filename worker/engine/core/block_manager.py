"""KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching by chained block hashes. No torch.

After nano-vllm / vLLM: a request's block table maps its positions to blocks of `block_size` slots. A full, computed
block is registered under a hash chained over everything before it, so a later request with the same prefix (same
token ids AND same images at the same places) reuses the block instead of recomputing it.

Free list policy: one ordered dict, allocated from the front. Blocks that carry no cached hash (never used, or freed
before they were full) go to the front, so they are reused first; blocks that hold a cached prefix go to the back in
the order they were freed, so the least recently freed cached block is evicted first (LRU). A request's blocks are
freed tail first, so the shared head of a prefix chain outlives its tail.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from worker.engine.core.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and computed and its content is findable by hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_block_by_hash: dict[bytes, int] = {}
        # Per request: hashes of its full blocks (its tokens only grow, so the chain only extends) and how many of
        # its blocks are already registered in the prefix cache.
        self._block_hashes: dict[str, list[bytes]] = {}
        self._num_registered_blocks: dict[str, int] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission -------------------------------------------------------------------------------------------------

    def cached_prefix_tokens(self, req: Request) -> int:
        """Positions of req whose KV `allocate(req)` would reuse from the prefix cache (read-only)."""
        return self._match_prefix(req)[1]

    def can_allocate(self, req: Request) -> bool:
        hit_block_ids, _ = self._match_prefix(req)
        # A cached block with no owner sits in the free list, so claiming it costs a free block too.
        num_reclaimed = sum(1 for b in hit_block_ids if self.blocks[b].ref_count == 0)
        num_new = self.num_blocks_for(req.num_tokens) - len(hit_block_ids)
        return num_new + num_reclaimed <= len(self._free)

    def allocate(self, req: Request) -> None:
        """Give req blocks for all its current tokens, reusing cached prefix blocks; sets its computed counts."""
        if req.block_ids:
            raise RuntimeError(f"request {req.request_id} already holds blocks")
        if not self.can_allocate(req):
            raise RuntimeError(f"not enough free KV blocks for request {req.request_id}")
        hit_block_ids, num_cached = self._match_prefix(req)
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        req.block_ids = hit_block_ids + [
            self._take_free_block() for _ in range(self.num_blocks_for(req.num_tokens) - len(hit_block_ids))
        ]
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        self._num_registered_blocks[req.request_id] = len(hit_block_ids)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += num_cached

    # -- growth ----------------------------------------------------------------------------------------------------

    def _num_missing_blocks(self, req: Request, num_new_tokens: int) -> int:
        return max(self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids), 0)

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        return self._num_missing_blocks(req, num_new_tokens) <= len(self._free)

    def append(self, req: Request, num_new_tokens: int) -> None:
        """Grow req's block table so positions up to num_computed_tokens + num_new_tokens have slots."""
        num_missing = self._num_missing_blocks(req, num_new_tokens)
        if num_missing > len(self._free):
            raise RuntimeError(f"not enough free KV blocks to grow request {req.request_id}")
        req.block_ids.extend(self._take_free_block() for _ in range(num_missing))

    def cache_computed_blocks(self, req: Request) -> None:
        """Register req's blocks that are now full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        start = self._num_registered_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._full_block_hashes(req, num_full)
        for i in range(start, num_full):
            block = self.blocks[req.block_ids[i]]
            # Another request may have registered identical content first; keep that one, leave this block anonymous.
            if block.block_hash is None and hashes[i] not in self._cached_block_by_hash:
                block.block_hash = hashes[i]
                self._cached_block_by_hash[hashes[i]] = block.block_id
        self._num_registered_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        """Drop req's references; unowned blocks return to the free list but stay findable by hash until reused."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        req.block_ids = []
        self._block_hashes.pop(req.request_id, None)
        self._num_registered_blocks.pop(req.request_id, None)

    # -- internals -------------------------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content: the slots are about to be overwritten
            if self._cached_block_by_hash.get(block.block_hash) == block_id:
                del self._cached_block_by_hash[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _match_prefix(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks at the head of req's tokens, and the number of positions they let it skip."""
        if not self.enable_prefix_caching:
            return [], 0
        # At least the last token is computed: the step needs its logits to sample.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit_block_ids: list[int] = []
        for block_hash in self._full_block_hashes(req, max_blocks):
            block_id = self._cached_block_by_hash.get(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        num_cached = self._round_down_outside_images(req, len(hit_block_ids) * self.block_size)
        return hit_block_ids[: num_cached // self.block_size], num_cached

    def _round_down_outside_images(self, req: Request, num_tokens: int) -> int:
        """Largest n <= num_tokens on a block boundary and not inside an image's run.

        Ending at the image's offset alone is not enough: the positions from there to the block's end would be
        recomputed into a block other requests share.
        """
        while True:
            inside = [im for im in req.images if im.offset < num_tokens < im.end]
            rounded = inside[0].offset if inside else num_tokens
            rounded -= rounded % self.block_size
            if rounded == num_tokens:
                return num_tokens
            num_tokens = rounded

    def _full_block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        hashes = self._block_hashes.setdefault(req.request_id, [])
        if len(hashes) < num_blocks:
            token_ids = req.all_token_ids
            parent = hashes[-1] if hashes else req.cache_salt.encode()
            for i in range(len(hashes), num_blocks):
                start = i * self.block_size
                end = start + self.block_size
                # Image placeholders share one token id: the images' identities and placements tell blocks apart.
                images = tuple((im.content_hash, im.offset - start, im.num_tokens) for im in req.images_in(start, end))
                parent = hashlib.sha256(repr((parent, token_ids[start:end], images)).encode()).digest()
                hashes.append(parent)
        return hashes[:num_blocks]
