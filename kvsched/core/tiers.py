"""The host-memory KV tier of one instance: its pool, the copies between it and the GPU pool,
and the pins those copies hold until a report acknowledges them.

The host pool is a `BlockPool` of its own (host block ids 0..num_host_blocks-1): its ref count
of a block is the number of copies in flight that read or write it (pins), its free list the
host LRU, its cache map the host half of the prefix index. The GPU pool's cache map is the other
half: `where(h)` answers for one hash in both tiers (a GPU block, a host block, or both).

    GPU block --swap-out (write policy)--> host block   registered under its hash on the ack
    host block --swap-in (a host hit)-----> fresh GPU block of the request that hit it

A copy lives through three stages: queued (decided during a schedule() or a report),
sent (in the Tasks message numbered `seq`), acknowledged (a report whose applied_seq >= seq:
the worker executes the copies of a message when it applies it, at a step boundary). A
swap-out's host block is pinned from its allocation to the ack and becomes a host hit only
then; a swap-in's source block is pinned from the hit to the ack. A failed swap-out registers
nothing; a failed swap-in forgets its source (suspect memory) and the request is preempted by
the caller (it recomputes). `reset()` (reset_prefix_cache) drops every host hash and any copy
not yet sent; copies in flight still release their pins on the ack but register nothing.

KV events (kv_events.py), when the GPU pool records them (`events_into`: the host tier writes
into the GPU pool's list, the one the scheduler drains): an acknowledged swap-out is a cpu
`BlockStored`, a host eviction or a failed swap-in's forgotten source a cpu `BlockRemoved`,
`reset()` a cpu `AllBlocksCleared`.

Imports `block_pool` only; `KVCacheManager` owns one when the instance has host blocks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsched.core.block_pool import BlockPool
from kvsched.core.config import WritePolicy
from kvsched.core.kv_events import CPU, BlockStored, KvEvent
from kvsched.core.storage import StorageTier


@dataclass(slots=True)
class _Sent:
    """The copies carried by one Tasks message, until a report acknowledges it."""

    seq: int
    outs: list[tuple[int, bytes]] = field(default_factory=list)  # (host block, hash)
    ins: list[tuple[int, int]] = field(default_factory=list)  # (handle, host block)
    epoch: int = 0


@dataclass(slots=True)
class TierStats:
    """Counters of one instance's host tier (blocks unless named otherwise)."""

    swap_outs: int = 0  # copies GPU -> host sent
    swap_ins: int = 0  # copies host -> GPU sent
    swap_out_failures: int = 0
    swap_in_failures: int = 0
    swap_outs_skipped: int = 0  # wanted, but every host block was pinned
    swap_ins_declined: int = 0  # host hits recomputed instead (cheaper by the cost model)
    swap_ins_ahead: int = 0  # swap-ins sent a message ahead of their request's first chunk


class HostTier:
    """Owns the host pool, the write policy's state and the copies queued or in flight."""

    def __init__(
        self, num_blocks: int, num_gpu_blocks: int, policy: WritePolicy, write_hits: int
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.pool.medium = CPU
        self._sink: BlockPool | None = None  # the pool whose event list host events join
        self.block_size = 0  # named in cpu BlockStored events
        self.policy = WritePolicy(policy)
        self.write_hits = write_hits
        self.stats = TierStats()
        # write_through_selective: GPU hits of each GPU block since it was registered.
        selective = self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        self._gpu_hits = [0] * num_gpu_blocks if selective else []
        # Queued swap-outs (gpu block, hash); their host blocks are taken when the message is
        # sealed (`take`: one allocation for all of them).
        self._outs: list[tuple[int, bytes]] = []
        self._ins: list[tuple[int, int, int]] = []  # queued swap-ins (handle, host, gpu)
        self._copying: set[bytes] = set()  # hashes with a swap-out queued or in flight
        self._sent: collections.deque[_Sent] = collections.deque()
        self._epoch = 0  # reset() count: a swap-out sent before a reset registers nothing
        self.swapped_last_ack = 0  # copies the last acknowledged messages carried (step cost)
        self._pending_record = _Sent(0)  # what `take` handed out, until `sent` numbers it
        self._outs_avg = 0.0  # swap-outs per message taken (moving average, for planning)
        # The storage tier below (core/storage.py), when the daemon has one: it writes host
        # blocks before they are evicted (write_back) or once they arrive (write_through).
        self.storage: StorageTier | None = None
        # Storage -> host prefetches (core/prefetch.py), when on: `relieve(want)` releases
        # landed prefetches' pins until `want` blocks are free; `prefetch_pins()` their pins.
        self.relieve: Callable[[int], None] | None = None
        self.prefetch_pins: Callable[[], dict[int, int]] | None = None

    @property
    def epoch(self) -> int:
        """reset() count: a copy into host memory sent before a reset registers nothing."""
        return self._epoch

    def sync_events(self) -> list[KvEvent] | None:
        return self._sync_events()

    def use_storage(self, storage: StorageTier) -> None:
        """Write to this storage tier what the host tier would lose (or what reaches it)."""
        self.storage = storage

    def events_into(self, gpu_pool: BlockPool, block_size: int) -> None:
        """Record host events into `gpu_pool.events` whenever that pool records (not None)."""
        self._sink = gpu_pool
        self.block_size = block_size

    def _sync_events(self) -> list[KvEvent] | None:
        """Point the host pool's event list at the GPU pool's current one (the scheduler swaps
        that list out when it drains it)."""
        ev = self._sink.events if self._sink is not None else None
        self.pool.events = ev
        return ev

    # ---- the index ---------------------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        return self.pool.cached.get(h)

    def run_from(self, hashes: list[bytes]) -> list[int]:
        """Host blocks holding the longest run of `hashes` from its start."""
        get, out = self.pool.cached.get, []
        for h in hashes:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    # ---- swap-outs (the write policies) ------------------------------------------------------
    def on_registered(self, gpu_block: int, h: bytes) -> None:
        """A GPU block was registered under `h` (its KV reported written)."""
        if self.policy is WritePolicy.WRITE_THROUGH:
            self.copy_out(gpu_block, h)
        elif self._gpu_hits:
            self._gpu_hits[gpu_block] = 0

    def on_gpu_hits(self, gpu_blocks: list[int], hashes: list[bytes | None]) -> None:
        """A request takes these cached GPU blocks as prefix hits."""
        if not self._gpu_hits:
            return
        counts, need = self._gpu_hits, self.write_hits
        for b, h in zip(gpu_blocks, hashes, strict=True):
            counts[b] += 1
            if counts[b] == need and h is not None:
                self.copy_out(b, h)

    def on_evicted(self, gpu_block: int, h: bytes) -> None:
        """The GPU pool evicted the block `h` was cached in (BlockPool.on_evict)."""
        if self.policy is WritePolicy.WRITE_BACK:
            self.copy_out(gpu_block, h)

    def copy_out(self, gpu_block: int, h: bytes) -> None:
        """Queue a copy of GPU block `gpu_block` (content `h`) into a host block, unless the
        host tier has that content (then it becomes the host LRU's youngest: it was just in use)
        or a copy of it is under way. The host block comes from the host LRU (evicting what it
        held); when every host block is pinned the copy is skipped."""
        pool = self.pool
        held = pool.cached.get(h)
        if held is not None:
            if pool.ref_cnt[held] == 0:
                pool.touch([held])
                pool.free([held])
            return
        if h in self._copying:
            return
        self._copying.add(h)
        self._outs.append((gpu_block, h))

    # ---- swap-ins ----------------------------------------------------------------------------
    def pin(self, host_blocks: list[int]) -> None:
        """Hold host blocks a request hit before anything can evict them."""
        self.pool.touch(host_blocks)

    def unpin(self, host_blocks: list[int]) -> None:
        self.pool.free(host_blocks)

    def copy_in(self, handle: int, host_blocks: list[int], gpu_blocks: list[int]) -> None:
        """Queue swap-ins for a placed handle (its host blocks pinned by `pin`)."""
        for hb, gb in zip(host_blocks, gpu_blocks, strict=True):
            self._ins.append((handle, hb, gb))

    # ---- the message and its acknowledgement -------------------------------------------------
    def take(
        self, dropped_handles: set[int]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """The queued copies for the Tasks message being sealed: swap-outs (gpu, host) and
        swap-ins (handle, host, gpu). Swap-ins of handles the same message drops are not sent
        (their pins are released now). Swap-outs get their host blocks now, from the host
        LRU (evicting what those held); those for which every host block is pinned are skipped.
        Call `sent(seq)` once the message is numbered."""
        want = self._outs
        pool = self.pool
        self._sync_events()  # allocate may evict host blocks: cpu BlockRemoved
        if self.relieve is not None and len(want) > pool.num_free:
            self.relieve(len(want))  # landed prefetches give their pins back first
        if self.storage is not None and want:  # write what would be lost, pinned till stored
            self.storage.save_host_victims(len(want))
        n = min(len(want), pool.num_free)
        if n < len(want):
            self.stats.swap_outs_skipped += len(want) - n
            for _, h in want[n:]:
                self._copying.discard(h)
            want = want[:n]
        hosts = pool.allocate(n) if n else []
        assert hosts is not None
        outs = [(g, hb) for (g, _), hb in zip(want, hosts, strict=True)]
        ins = self._ins
        if dropped_handles and ins:
            keep = [c for c in ins if c[0] not in dropped_handles]
            self.unpin([hb for hnd, hb, _ in ins if hnd in dropped_handles])
            ins = keep
        self._pending_record = _Sent(
            0,
            [(hb, h) for hb, (_, h) in zip(hosts, want, strict=True)],
            [(hnd, hb) for hnd, hb, _ in ins],
            self._epoch,
        )
        self._outs, self._ins = [], []
        self._outs_avg += 0.1 * (len(outs) - self._outs_avg)
        self.stats.swap_outs += len(outs)
        self.stats.swap_ins += len(ins)
        return outs, ins

    def sent(self, seq: int) -> None:
        """The copies `take` returned went out in Tasks message `seq`."""
        rec = self._pending_record
        if rec.outs or rec.ins:
            rec.seq = seq
            self._sent.append(rec)
        self._pending_record = _Sent(0)

    def has_queued(self) -> bool:
        return bool(self._outs or self._ins)

    @property
    def num_queued(self) -> int:
        """Copies the next message is expected to carry (they run at its step boundary): those
        queued now, or, when more, the recent average of swap-outs per message (write_back
        decides its copies while the step allocates, after its time is planned)."""
        outs = len(self._outs)
        if self.policy is WritePolicy.WRITE_BACK:
            outs = max(outs, round(self._outs_avg))
        return outs + len(self._ins)

    def acknowledge(
        self, applied_seq: int, failed_outs: list[int], failed_in_handles: list[int]
    ) -> None:
        """A report says the worker applied every Tasks message up to `applied_seq`: their
        copies are done, except swap-outs into `failed_outs` (host ids) and swap-ins of
        `failed_in_handles`. Registers what the swap-outs wrote and releases every pin."""
        sent, pool = self._sent, self.pool
        events = self._sync_events()
        stored: list[bytes] = []
        bad_out = set(failed_outs) if failed_outs else ()
        bad_in = set(failed_in_handles) if failed_in_handles else ()
        n = 0
        copying, cached, block_hash = self._copying, pool.cached, pool.block_hash
        while sent and sent[0].seq <= applied_seq:
            rec = sent.popleft()
            n += len(rec.outs) + len(rec.ins)
            register = rec.epoch == self._epoch
            for hb, h in rec.outs:
                copying.discard(h)
                if hb in bad_out:
                    self.stats.swap_out_failures += 1
                elif register and h not in cached:  # (BlockPool.cache_block, inlined)
                    cached[h] = hb
                    block_hash[hb] = h
                    stored.append(h)
            # The pins: cached blocks go to the LRU's young end.
            pool.free([hb for hb, _ in rec.outs])
            if rec.ins:
                for handle, hb in rec.ins:
                    if handle in bad_in:
                        self.stats.swap_in_failures += 1
                        pool.forget(hb)  # its content is suspect: never hit again
                pool.free([hb for _, hb in rec.ins])
        if events is not None and stored:
            events.append(BlockStored(stored, None, [], self.block_size, None, CPU))
        if stored and self.storage is not None and self.storage.write_through:
            self.storage.on_host_stored([(cached[h], h) for h in stored])
        self.swapped_last_ack = n

    def reset(self) -> int:
        """Forget every host hash (reset_prefix_cache) and the copies not yet sent; copies in
        flight release their pins on the ack and register nothing. Returns hashes dropped."""
        self._epoch += 1
        self._sync_events()  # a cpu AllBlocksCleared
        self._outs = []
        self._copying = {h for rec in self._sent for _, h in rec.outs}
        if self._gpu_hits:
            self._gpu_hits = [0] * len(self._gpu_hits)
        return self.pool.reset_cache()

    # ---- figures and checks ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_in_flight(self) -> int:
        return sum(len(r.outs) + len(r.ins) for r in self._sent)

    def check_integrity(self) -> None:
        """Every host block's ref count equals the copies queued or in flight naming it (the
        storage tier's writes included); a block being written holds no hash; the copy set is
        exactly the swap-outs under way."""
        pins: dict[int, int] = dict(self.storage.host_pins()) if self.storage is not None else {}
        if self.prefetch_pins is not None:
            for hb, n in self.prefetch_pins().items():
                pins[hb] = pins.get(hb, 0) + n
        writing: list[tuple[int, bytes]] = []
        reading = [hb for _, hb, _ in self._ins]
        for rec in self._sent:
            writing.extend(rec.outs)
            reading.extend(hb for _, hb in rec.ins)
        for hb, _ in writing:
            pins[hb] = pins.get(hb, 0) + 1
        for hb in reading:
            pins[hb] = pins.get(hb, 0) + 1
        self.pool.check_integrity(pins)
        for hb, _ in writing:
            assert pins[hb] == 1, f"host block {hb} written by a copy and pinned otherwise"
            assert self.pool.block_hash[hb] is None, f"host block {hb} cached while written"
        under_way = {h for rec in self._sent if rec.epoch == self._epoch for _, h in rec.outs}
        under_way |= {h for _, h in self._outs}
        assert under_way <= self._copying, "a swap-out under way is not in the copy set"
        live = {h for rec in self._sent for _, h in rec.outs} | {h for _, h in self._outs}
        assert self._copying <= live, "the copy set names a hash no copy writes"
