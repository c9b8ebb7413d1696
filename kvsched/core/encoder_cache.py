"""The encoder cache of one instance: which multimodal items' encoder outputs its worker holds.

A multimodal item (`MultimodalRange`) is keyed by its `content_hash`; its encoder output is
`length` embeddings. The worker encodes an item when a chunk first needs it and keeps the
output until a Tasks message names the item in `encoder_drops` (or resets the prefix cache).
This module is the daemon's copy of that cache, so the scheduler

- charges the step's encoder budget only for items the worker does not hold (a miss: the
  whole item is encoded at once, `length` tokens); a hit costs nothing;
- keeps the worker's cache within `capacity` embeddings: before a miss is sent, items no
  running request still needs are evicted, least recently used first, and their hashes go
  out in the next Tasks message (`take_drops`);
- never evicts an item a running request still needs: a request that was sent a chunk
  touching the item needs it until the worker reports its KV past the item's last position
  (the scheduler's predicate `needed(req, handle, content_hash)` decides, at eviction time).

A chunk that would need a miss the cache cannot make room for stops before that item (like
the encoder budget): the request waits for running requests to pass their items.

`reset()` (reset_prefix_cache) forgets every item no running request needs; the worker drops
everything and re-encodes what a queued chunk needs. Pure: no I/O, no clocks. Imported by the
scheduler's admission and integrity parts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass

from kvsched.core.request import Request

# (request, its handle when it touched the item, content hash) -> it still needs the item
Needed = Callable[[Request, int, str], bool]


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0  # items a request found cached (once per request placement and item)
    misses: int = 0  # items the worker had to encode
    evictions: int = 0  # items dropped to make room (not counting resets)


class EncoderCache:
    """The encoder outputs one worker holds, in embeddings (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, int] = OrderedDict()  # hash -> embeddings, LRU first
        self.used = 0
        # hash -> {request: the handle it touched the item under}: who may still need it
        self.users: dict[str, dict[Request, int]] = {}
        self._drops: list[str] = []  # evicted since the last Tasks message
        self.stats = EncoderCacheStats()

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self.items

    def can_fit(self, size: int, needed: Needed, exclude: Container[str]) -> bool:
        """Room for `size` more embeddings, evicting only items no running request needs
        (and none in `exclude`: the items the chunk being sized touches)? Evicts nothing (it
        forgets users that no longer need an item)."""
        free = self.capacity - self.used
        if free >= size:
            return True
        for h, n in self.items.items():
            if h not in exclude and not self._needed(h, needed):
                free += n
                if free >= size:
                    return True
        return False

    def use(self, req: Request, content_hash: str, size: int, needed: Needed) -> bool:
        """req's chunk (sent now) touches the item: a hit, or a miss that is inserted after
        evicting unneeded items. Returns True on a miss (the encoder budget pays for it).
        The caller checked `can_fit` for a miss."""
        users = self.users.setdefault(content_hash, {})
        first = users.get(req) != req.handle
        users[req] = req.handle
        if content_hash in self.items:
            self.items.move_to_end(content_hash)
            if first:
                self.stats.hits += 1
            return False
        self._evict_for(size, needed, content_hash)
        self.items[content_hash] = size
        self.used += size
        self.stats.misses += 1
        return True

    def _evict_for(self, size: int, needed: Needed, keep: str) -> None:
        for h in list(self.items):
            if self.capacity - self.used >= size:
                return
            if h != keep and not self._needed(h, needed):
                self._remove(h)
                self._drops.append(h)
                self.stats.evictions += 1
        assert self.capacity - self.used >= size, "encoder cache: miss without room"

    def _needed(self, content_hash: str, needed: Needed) -> bool:
        """Some user still needs the item; users that no longer do are forgotten."""
        users = self.users.get(content_hash)
        if not users:
            return False
        for req, handle in list(users.items()):
            if needed(req, handle, content_hash):
                return True
            del users[req]
        del self.users[content_hash]
        return False

    def _remove(self, content_hash: str) -> None:
        self.used -= self.items.pop(content_hash)
        self.users.pop(content_hash, None)

    def take_drops(self) -> list[str]:
        """The items evicted since the last call: the next Tasks message's `encoder_drops`."""
        drops, self._drops = self._drops, []
        return drops

    def reset(self, needed: Needed) -> int:
        """reset_prefix_cache: forget every item no running request needs (the worker drops
        all and re-encodes on demand). Pending drops are moot: the reset covers them.
        Returns the number of items forgotten."""
        gone = [h for h in self.items if not self._needed(h, needed)]
        for h in gone:
            self._remove(h)
        self._drops = []
        return len(gone)

    def check_integrity(self, needed: Needed) -> None:
        """Assert the cache's invariants (tests): within capacity, `used` equal to the sum of
        sizes, users only of cached items, no item both cached and being dropped."""
        assert self.used == sum(self.items.values()), "encoder cache: used drifted"
        assert 0 <= self.used <= self.capacity, f"encoder cache over capacity: {self.used}"
        assert all(n > 0 for n in self.items.values()), "encoder cache: empty item"
        assert set(self.users) <= set(self.items), "encoder cache: user of an evicted item"
        assert not set(self._drops) & set(self.items), "encoder cache: item cached and dropped"
        for h, users in self.users.items():
            for req, handle in users.items():
                if needed(req, handle, h):
                    assert any(r.content_hash == h for r in req.mm_ranges), (
                        f"{req.req_id}: needs encoder item {h} it does not have"
                    )
