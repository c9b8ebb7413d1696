"""Storage -> host prefetch: a queued request's storage hits are got into host blocks while it
waits, so at its placement they are host hits (swap-ins over PCIe) instead of storage fetches
on the step's critical path (docs/STORAGE.md, "Prefetch").

    queued request, prefix run GPU | host | storage      (`KVCacheManager.lookup`)
        -> prefetch (key, host block) for the storage part, the host blocks pinned
        -> the worker gets the keys into those host blocks beside its step (a Tasks message)
        -> acknowledged (a report's applied_seq): the host blocks are registered under their
           hashes, still pinned for the request
        -> placed: `lookup` finds them as host hits (swapped in, pinned by the swap-ins);
           the prefetch's pins are released

A prefetch lives through queued (decided, not sent: host blocks allocated and pinned), sent
(in the Tasks message numbered `seq`), landed (acknowledged: registered, pinned until the
request is placed or gone). Its pins are released when its request is placed, ends or leaves
(`release`), when the host tier needs blocks for swap-outs and only landed prefetches hold
them (`relieve`, oldest first: the request then gets whatever the host LRU keeps), or, for a
prefetch in flight, at its acknowledgement (the worker may still be writing the block). A
failed prefetch (`failed_storage_prefetches`, by host block) registers nothing and takes its
key out of the index (the store may have lost it), as a failed fetch does. A prefetch sent
before `reset_prefix_cache` registers nothing (the worker cleared host memory).

At most `max_pinned` host blocks are pinned by prefetches at once (a quarter of the host tier
by default), so swap-outs always find blocks. Needs a host tier and a storage tier.

Imports `block_pool`, `request`, `storage` and `tiers` only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvsched.core.request import Request
from kvsched.core.storage import StorageTier
from kvsched.core.tiers import HostTier


@dataclass(slots=True)
class _Prefetch:
    """One request's prefetch: keys got into host blocks (pinned)."""

    req: Request
    hashes: list[bytes]
    keys: list[str]
    blocks: list[int]  # host blocks, one pin each
    since: float = 0.0  # issued at (the scheduler's clock)
    seq: int = 0  # the Tasks message that carried it (0: queued)
    epoch: int = 0  # the host tier's reset count when it was sent
    landed: bool = False  # acknowledged: its good blocks are registered
    dropped: bool = False  # released while in flight: its pins go at the acknowledgement
    failed: set[int] = field(default_factory=set)  # host blocks whose get failed


@dataclass(slots=True)
class PrefetchStats:
    """Counters (blocks)."""

    prefetches: int = 0  # sent
    failures: int = 0
    hits: int = 0  # taken as host hits at their request's placement
    relieved: int = 0  # pins released early for swap-outs
    unused: int = 0  # released without being taken (the request ended, or took fewer)


class Prefetcher:
    """Owns the prefetches of one instance: queued, in flight, landed, and their host pins."""

    def __init__(self, host: HostTier, storage: StorageTier, max_pinned: int = 0) -> None:
        self.host, self.storage = host, storage
        self.max_pinned = max_pinned or max(1, host.num_blocks // 4)
        self.stats = PrefetchStats()
        self._by_req: dict[str, _Prefetch] = {}  # live (queued, sent or landed, not dropped)
        self._queued: list[_Prefetch] = []
        self._sent: collections.deque[_Prefetch] = collections.deque()  # in seq order
        self._pending: list[_Prefetch] = []  # handed out by `take`, until `sent`
        self.num_pinned = 0

    # ---- issuing --------------------------------------------------------------------------
    def issue(
        self, req: Request, host_hits: list[int], hashes: list[bytes], now: float = 0.0
    ) -> int:
        """Prefetch the stored blocks `hashes` that continue req's prefix run (after its GPU
        hits and the host blocks `host_hits`). Returns the blocks queued (0: none: already
        prefetching, no room under max_pinned, or no free host block)."""
        if req.req_id in self._by_req or not hashes:
            return 0
        pool = self.host.pool
        n = min(len(hashes), self.max_pinned - self.num_pinned)
        if n <= 0:
            return 0
        if host_hits:  # the run's host part becomes the youngest: not evicted for this
            pool.touch(host_hits)
            pool.free(host_hits)
        self.host.sync_events()  # allocate may evict host blocks: cpu BlockRemoved
        if self.storage.host_pool is not None:
            self.storage.save_host_victims(n)  # write_back: what would be lost is written
        n = min(n, pool.num_free)
        if n <= 0:
            return 0
        blocks = pool.allocate(n)
        assert blocks is not None
        hashes = hashes[:n]
        rec = _Prefetch(req, hashes, self.storage.keys(hashes), blocks, now)
        self._by_req[req.req_id] = rec
        self._queued.append(rec)
        self.num_pinned += n
        return n

    def pending_since(self, req: Request) -> float | None:
        """When req's prefetch was issued, while it is queued or in flight (else None)."""
        rec = self._by_req.get(req.req_id)
        return rec.since if rec is not None and not rec.landed else None

    def has(self, req: Request) -> bool:
        return req.req_id in self._by_req

    def landed_blocks(self, req: Request) -> set[int]:
        """The host blocks a landed prefetch of req got (registered, good)."""
        rec = self._by_req.get(req.req_id)
        if rec is None or not rec.landed:
            return set()
        return set(rec.blocks) - rec.failed

    # ---- releasing ------------------------------------------------------------------------
    def release(self, req: Request, taken: int = 0) -> None:
        """req no longer needs its prefetch (placed, taking `taken` of its blocks as hits;
        ended; left): its pins go now, or at the acknowledgement when in flight."""
        rec = self._by_req.pop(req.req_id, None)
        if rec is None:
            return
        self.stats.hits += taken
        self.stats.unused += len(rec.blocks) - len(rec.failed) - taken
        if rec.seq == 0:  # queued: never sent, nothing was written
            self._queued.remove(rec)
            self._unpin(rec)
        elif rec.landed:
            self._unpin(rec)
        else:
            rec.dropped = True

    def relieve(self, want: int) -> None:
        """The host tier needs `want` more free blocks: release landed prefetches, oldest
        first, until it has them (their requests get what the host LRU keeps)."""
        pool = self.host.pool
        for rec in list(self._by_req.values()):
            if pool.num_free >= want:
                return
            if rec.landed:
                self.stats.relieved += len(rec.blocks)
                self.release(rec.req)

    def _unpin(self, rec: _Prefetch) -> None:
        self.num_pinned -= len(rec.blocks)
        self.host.pool.free(rec.blocks)

    # ---- the message and its acknowledgement ----------------------------------------------
    def has_queued(self) -> bool:
        return bool(self._queued)

    def take(self) -> tuple[list[str], list[int]]:
        """The queued prefetches for the Tasks message being sealed: keys and host blocks.
        Call `sent(seq)` once the message is numbered."""
        recs, self._queued = self._queued, []
        self._pending = recs
        keys = [k for r in recs for k in r.keys]
        blocks = [b for r in recs for b in r.blocks]
        self.stats.prefetches += len(blocks)
        return keys, blocks

    def sent(self, seq: int) -> None:
        epoch = self.host.epoch
        for rec in self._pending:
            rec.seq, rec.epoch = seq, epoch
            self._sent.append(rec)
        self._pending = []

    def acknowledge(self, applied_seq: int, failed_blocks: list[int]) -> None:
        """The worker applied every message up to applied_seq: their prefetches landed but
        for the host blocks in `failed_blocks` (their keys leave the index)."""
        sent = self._sent
        if not sent or sent[0].seq > applied_seq:
            return
        bad = {int(b) for b in failed_blocks} if failed_blocks else set()
        pool = self.host.pool
        self.host.sync_events()
        cached, block_hash = pool.cached, pool.block_hash
        epoch = self.host.epoch
        gone: list[str] = []
        while sent and sent[0].seq <= applied_seq:
            rec = sent.popleft()
            rec.landed = True
            for b, h, key in zip(rec.blocks, rec.hashes, rec.keys, strict=True):
                if b in bad:
                    rec.failed.add(b)
                    gone.append(key)
                elif rec.epoch == epoch and h not in cached:
                    cached[h] = b
                    block_hash[b] = h
            self.stats.failures += len(rec.failed)
            if rec.dropped:
                self._unpin(rec)
        if gone:
            self.storage.forget(gone)

    def reset(self) -> None:
        """reset_prefix_cache: nothing to do here (the host tier's epoch moves; a prefetch
        sent before it registers nothing; queued ones are sent after the reset's message)."""

    # ---- figures and checks ---------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return sum(len(r.blocks) for r in self._sent)

    def host_pins(self) -> dict[int, int]:
        """Host block -> pins held by prefetches (queued, in flight, landed and not released)."""
        pins: dict[int, int] = {}
        recs = {id(r): r for r in (*self._by_req.values(), *self._sent, *self._pending)}
        for r in recs.values():
            for b in r.blocks:
                pins[b] = pins.get(b, 0) + 1
        return pins

    def check_integrity(self, waiting: set[str]) -> None:
        """Every live prefetch belongs to a waiting request; pins counted once each; a block
        being written holds no hash; in-flight order by seq."""
        for rid, rec in self._by_req.items():
            assert rid in waiting, f"prefetch held for {rid}, not waiting"
            assert not rec.dropped
        held = {id(r) for r in self._by_req.values()}
        for r in self._sent:
            assert r.seq > 0 and not r.landed
            assert id(r) in held or r.dropped, "a prefetch in flight nobody owns"
        for r in self._queued:
            assert r.seq == 0 and id(r) in held
        total = sum(len(r.blocks) for r in self._by_req.values())
        total += sum(len(r.blocks) for r in self._sent if r.dropped)
        assert total == self.num_pinned, f"prefetch pins {self.num_pinned} != {total}"
        assert self.num_pinned <= self.max_pinned
        pool = self.host.pool
        for r in (*self._queued, *self._sent):
            for b in r.blocks:
                assert pool.block_hash[b] is None, f"host block {b} being prefetched holds a hash"
