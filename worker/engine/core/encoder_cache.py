"""Bookkeeping for image embeddings keyed by content hash: ref-counted by request, LRU-evicted. No torch.

Sizes are counted in embedding rows (= LM positions an image fills). The embeddings themselves are the model
runner's; this module only says which hashes the runner holds. An entry exists from `allocate` (space
reserved, the image is being encoded this step) until it is evicted; `mark_encoded` records that its step
ran. Every hash that leaves the cache is also queued for `take_freed`, which the scheduler passes on to the
runner so that it deletes the embedding too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Entry:
    num_tokens: int
    encoded: bool = False  # its step ran, so the runner holds its embedding
    request_ids: set[str] = field(default_factory=set)


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError("capacity_tokens must be >= 1")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._requests: dict[str, set[str]] = {}  # request id -> hashes it references
        self._freed: list[str] = []  # hashes dropped since the last take_freed()
        self.num_used_tokens = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def is_encoded(self, content_hash: str) -> bool:
        entry = self._entries.get(content_hash)
        return entry is not None and entry.encoded

    def num_refs(self, content_hash: str) -> int:
        entry = self._entries.get(content_hash)
        return len(entry.request_ids) if entry else 0

    @property
    def num_evictable_tokens(self) -> int:
        return sum(e.num_tokens for e in self._entries.values() if not e.request_ids)

    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens <= self.capacity_tokens - self.num_used_tokens + self.num_evictable_tokens

    def allocate(self, content_hash: str, num_tokens: int) -> list[str]:
        """Reserve room for an embedding about to be encoded (a miss); returns the hashes evicted to make room."""
        if content_hash in self._entries:
            raise KeyError(f"embedding {content_hash} is already cached")
        if not self.can_allocate(num_tokens):
            raise RuntimeError(f"encoder cache cannot hold {num_tokens} more tokens")
        evicted: list[str] = []
        for victim, entry in list(self._entries.items()):
            if self.num_used_tokens + num_tokens <= self.capacity_tokens:
                break
            if not entry.request_ids:
                del self._entries[victim]
                self.num_used_tokens -= entry.num_tokens
                evicted.append(victim)
        self._entries[content_hash] = _Entry(num_tokens)
        self.num_used_tokens += num_tokens
        self.num_misses += 1
        self.num_evictions += len(evicted)
        self._freed.extend(evicted)
        return evicted

    def mark_encoded(self, content_hash: str) -> None:
        """The step that encoded this image ran: the runner holds its embedding. A no-op for an entry that is
        gone (its request was aborted while the step ran; the hash is already queued as freed)."""
        entry = self._entries.get(content_hash)
        if entry is not None:
            entry.encoded = True

    def take_freed(self) -> list[str]:
        """Hashes that left the cache since the last call: the runner must delete their embeddings."""
        freed, self._freed = self._freed, []
        return freed

    def add_ref(self, content_hash: str, request_id: str) -> None:
        entry = self._entries[content_hash]
        # A hit unless this is the first reference to an entry reserved this step (that request caused the miss).
        if entry.encoded or entry.request_ids:
            self.num_hits += 1
        entry.request_ids.add(request_id)
        self._requests.setdefault(request_id, set()).add(content_hash)
        self._entries.move_to_end(content_hash)

    def remove_ref(self, content_hash: str, request_id: str) -> None:
        """The request no longer needs this embedding (its positions are in the KV cache); it becomes evictable."""
        entry = self._entries.get(content_hash)
        if entry is not None:
            entry.request_ids.discard(request_id)
            if not entry.encoded and not entry.request_ids:
                # Reserved but its step never finished (it failed, or its request was aborted first): a later
                # request must encode the image again, and whatever the runner may have stored is stale.
                del self._entries[content_hash]
                self.num_used_tokens -= entry.num_tokens
                self._freed.append(content_hash)
        hashes = self._requests.get(request_id)
        if hashes is not None:
            hashes.discard(content_hash)
            if not hashes:
                del self._requests[request_id]

    def release(self, request_id: str) -> None:
        """Drop every reference the request holds."""
        for content_hash in list(self._requests.get(request_id, ())):
            self.remove_ref(content_hash, request_id)
