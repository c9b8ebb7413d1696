"""The block pool: mechanism only. Knows blocks, reference counts and the cache map; nothing of
requests or queues.

Free blocks sit in one doubly linked list ordered for eviction:

    head -> [uncached free blocks] [cached free blocks, least recently used first] <- tail

`allocate` takes from the head (an evicted cached block loses its hash); `free` puts a block
whose ref count reaches zero at the tail if it holds a cached prefix (most recently used), else
at the head (it has no value). `touch` takes a cached free block back out in O(1) on a hit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvsched.core.kv_events import GPU, AllBlocksCleared, BlockRemoved, KvEvent


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Linked list over block ids; index num_blocks is the sentinel.
        s = num_blocks
        self._next = [*range(1, num_blocks + 1), 0]
        self._prev = [s, *range(num_blocks)]
        if num_blocks == 0:
            self._next, self._prev = [s], [s]
        self._next[s] = 0 if num_blocks else s
        self._prev[s] = num_blocks - 1 if num_blocks else s
        self.num_free = num_blocks
        # Called with (block, hash) when `allocate` evicts the block a hash was cached in (the
        # host tier's write_back policy copies it out); None: nobody listens.
        self.on_evict: Callable[[int, bytes], None] | None = None
        # Prefix-cache changes for a consumer (None: nobody asked: nothing is recorded).
        self.events: list[KvEvent] | None = None
        self.medium = GPU  # the tier its events name (kv_events.MEDIA)

    def record_events(self) -> None:
        """Record the prefix cache's changes from now on (`take_events` drains them). The
        first event is AllBlocksCleared: a consumer's view starts empty. Once is enough."""
        if self.events is None:
            self.events = [AllBlocksCleared()]

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first ([] when not recording). The
        list is swapped out, not emptied: whoever holds the old one keeps what it had."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    # ---- free list primitives -------------------------------------------------------------
    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p] = n
        self._prev[n] = p
        self.num_free -= 1

    def _link_after(self, p: int, b: int) -> None:
        n = self._next[p]
        self._prev[b], self._next[b] = p, n
        self._next[p] = b
        self._prev[n] = b
        self.num_free += 1

    def free_order(self) -> list[int]:
        """Free block ids in eviction order (head first). O(free blocks): tests only."""
        s, out, b = self.num_blocks, [], self._next[self.num_blocks]
        while b != s:
            out.append(b)
            b = self._next[b]
        return out

    def iter_free(self) -> Iterator[int]:
        """Free block ids in eviction order (head first), lazily: stop early, change nothing
        while iterating."""
        s, nxt = self.num_blocks, self._next
        b = nxt[s]
        while b != s:
            yield b
            b = nxt[b]

    # ---- public API -----------------------------------------------------------------------
    def allocate(self, num: int) -> list[int] | None:
        """Take `num` blocks from the head of the free list, each with ref count 1; a taken
        cached block is evicted (loses its hash). Returns None, changing nothing, if too few."""
        if num > self.num_free:
            return None
        s, nxt, prv, ref, hashes = (
            self.num_blocks,
            self._next,
            self._prev,
            self.ref_cnt,
            self.block_hash,
        )
        out = []
        evicted: list[bytes] | None = None
        for _ in range(num):
            b = nxt[s]  # the head: unlinked here (as _unlink, inlined: every extension)
            n = nxt[b]
            nxt[s] = n
            prv[n] = s
            ref[b] = 1
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.on_evict is not None:
                        self.on_evict(b, h)
                    if self.events is not None:
                        if evicted is None:
                            evicted = []
                        evicted.append(h)
            out.append(b)
        self.num_free -= num
        if evicted:
            assert self.events is not None
            self.events.append(BlockRemoved(evicted, self.medium))
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the order given (pass a table reversed so
        chain tails are evicted before their parents). Blocks reaching zero become free."""
        s, ref, hashes = self.num_blocks, self.ref_cnt, self.block_hash
        for b in block_ids:
            ref[b] -= 1
            if ref[b] == 0:
                self._link_after(self._prev[s] if hashes[b] is not None else s, b)

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to each block (a prefix hit); a free one leaves the free list."""
        ref = self.ref_cnt
        for b in block_ids:
            if ref[b] == 0:
                self._unlink(b)
            ref[b] += 1

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a written, full block under its hash. False (nothing changes) if caching is
        off or another block already holds that content."""
        if not self.enable_caching or block_hash in self.cached:
            return False
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def forget(self, block_id: int) -> None:
        """Drop the hash a block is cached under (a free one moves to the list's head)."""
        h = self.block_hash[block_id]
        if h is None:
            return
        self.block_hash[block_id] = None
        if self.cached.get(h) == block_id:
            del self.cached[h]
            if self.events is not None:
                self.events.append(BlockRemoved([h], self.medium))
        if self.ref_cnt[block_id] == 0:
            self._unlink(block_id)
            self._link_after(self.num_blocks, block_id)

    def reset_cache(self) -> int:
        """Forget every cached hash (in-use blocks stay owned). Returns how many were dropped."""
        n = len(self.cached)
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared(self.medium))
        return n

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def check_integrity(self, owners: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; with `owners` (block -> number of tables holding it),
        also that ref counts equal owners and free xor owned."""
        free = self.free_order()
        assert len(free) == self.num_free, "free list length != num_free"
        free_set = set(free)
        assert len(free_set) == len(free), "a block is twice in the free list"
        for b in range(self.num_blocks):
            assert (b in free_set) == (self.ref_cnt[b] == 0), f"block {b}: free xor owned broken"
            assert self.ref_cnt[b] >= 0, f"block {b}: negative ref count"
            if owners is not None:
                assert self.ref_cnt[b] == owners.get(b, 0), (
                    f"block {b}: ref count {self.ref_cnt[b]} != owners {owners.get(b, 0)}"
                )
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"block {b}: cache map and block hash disagree"
        n_hashed = sum(1 for h in self.block_hash if h is not None)
        assert n_hashed == len(self.cached), "a block carries a hash not in the cache map"
        # Uncached free blocks precede cached ones.
        seen_cached = False
        for b in free:
            if self.block_hash[b] is not None:
                seen_cached = True
            else:
                assert not seen_cached, f"uncached free block {b} after a cached one"
