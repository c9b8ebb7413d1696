"""The storage KV tier: a store shared by every instance of every daemon (Mooncake Store), as
the daemon sees it. The daemon decides, the worker moves bytes (protocol step 13).

Two parts:

    StorageIndex   ONE per daemon, shared by all its instances' schedulers (the store is
                   shared): the keys believed stored (acknowledged writes, the daemon's own or
                   a peer's, learnt from KV events) and the keys some instance is writing now
                   (so two instances never write the same content at once).
    StorageTier    one per scheduler (`KVCacheManager.storage`): its key namespace (model and
                   block size), its write policy, and its writes and fetches queued -> sent ->
                   acknowledged, like the host tier's copies (`tiers.py`).

Keys are strings built from the model, the block size and the chained block hash (the hash
covers the LoRA name, the cache salt and multimodal items, `kv_cache_manager`), so equal
prefixes are equal keys on every instance of every daemon:

    key = f"{model}/{block_size}/{hash.hex()}"

Writes. An instance with a host tier writes from host blocks: under `write_back` (the default)
when the host tier is about to evict a block whose key is not stored (the host block is pinned
from then until the write is acknowledged, so the swap-out that wanted it takes another block;
once acknowledged the block is evicted, its content living on in the store),
under `write_through` once a swap-out into the host tier is acknowledged (pinned likewise). An
instance without a host tier writes from GPU blocks: under `write_back` when the GPU pool
evicts a block (the write runs at the boundary of the message that carries it, before any chunk
of that message overwrites the block, as a swap-out on eviction does), under `write_through`
once a block is registered. A write that failed is never counted as stored; a key becomes a hit
(for this instance and every other) only once its write is acknowledged.

Fetches. A prefix hit continues GPU -> host -> storage (`StorageIndex.run_from`); each storage
hit gets a fresh GPU block of the request and a fetch task ordered after its swap-ins. A fetch
that failed (the store evicted the key, the store is down) preempts its request (it recomputes,
the caller does it) and takes that handle's keys out of the index: they may be gone.

KV events (medium `storage`), into the GPU pool's list when it records: a write acknowledged is
a storage `BlockStored` (hashes only), a failed fetch's keys a storage `BlockRemoved`.
`reset_prefix_cache` does not touch the store (its keys name content, valid everywhere); it
drops the writes not yet sent.

Imports `block_pool`, `kv_events` and `storage_index` only.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvsched.core.block_pool import BlockPool
from kvsched.core.kv_events import STORAGE, BlockRemoved, BlockStored
from kvsched.core.storage_index import DEFAULT_MAX_KEYS, StorageIndex

__all__ = ["DEFAULT_MAX_KEYS", "StorageIndex", "StorageStats", "StorageTier"]


@dataclass(slots=True)
class _Sent:
    """The storage tasks carried by one Tasks message, until a report acknowledges it."""

    seq: int
    writes: list[tuple[str, int, bool]] = field(default_factory=list)  # key, block, pinned
    fetches: list[tuple[int, str]] = field(default_factory=list)  # handle, key


@dataclass(slots=True)
class StorageStats:
    """Counters of one instance's storage tier (blocks)."""

    writes: int = 0  # writes sent
    fetches: int = 0  # fetches sent
    write_failures: int = 0
    fetch_failures: int = 0
    fetches_declined: int = 0  # storage hits recomputed instead (cheaper by the cost model)
    fetches_ahead: int = 0  # fetches sent a message ahead of their request's first chunk
    writes_skipped: int = 0  # wanted, but every host block was pinned / dropped on a reset


class StorageTier:
    """One scheduler's view of the shared store: key namespace, write policy, tasks in flight.

    `from_host`: the instance has a host tier (writes read host blocks, pinned in `host_pool`
    until acknowledged); otherwise writes read GPU blocks and pin nothing.
    `write_through`: write as soon as a block reaches the source tier (else on its eviction)."""

    def __init__(
        self,
        index: StorageIndex,
        namespace: str,
        block_size: int,
        write_through: bool = False,
        host_pool: BlockPool | None = None,
    ) -> None:
        self.index = index
        self.prefix = f"{namespace}/{block_size}/"
        self.block_size = block_size
        self.write_through = write_through
        self.host_pool = host_pool  # None: writes are from GPU blocks
        self._sink: BlockPool | None = None  # the pool whose event list storage events join
        self.stats = StorageStats()
        self._writes: list[tuple[str, int, bool]] = []  # queued (key, block, pinned)
        self._fetches: list[tuple[int, str, int]] = []  # queued (handle, key, gpu block)
        self._sent: collections.deque[_Sent] = collections.deque()
        self._pending = _Sent(0)
        self.fetched_last_ack = 0  # fetches the last acknowledged messages carried (step cost)

    def events_into(self, gpu_pool: BlockPool) -> None:
        self._sink = gpu_pool

    def key(self, h: bytes) -> str:
        return self.prefix + h.hex()

    def keys(self, hashes: Iterable[bytes]) -> list[str]:
        p = self.prefix
        return [p + h.hex() for h in hashes]

    # ---- lookups ---------------------------------------------------------------------------
    def run_from(self, hashes: list[bytes]) -> list[str]:
        """Keys of the longest stored run of `hashes` from its start."""
        if not hashes or not len(self.index):
            return []
        return self.index.run_from(self.keys(hashes))

    # ---- writes ----------------------------------------------------------------------------
    def write(self, block: int, h: bytes) -> None:
        """Queue a write of `block` (content `h`) unless its key is stored or being written;
        a host block is pinned until the write is acknowledged."""
        key = self.key(h)
        if not self.index.begin_write(key):
            return
        pinned = self.host_pool is not None
        if pinned:
            assert self.host_pool is not None
            self.host_pool.touch([block])
        self._writes.append((key, block, pinned))

    def on_gpu_registered(self, gpu_block: int, h: bytes) -> None:
        """No host tier: a GPU block was registered (write_through writes it now)."""
        if self.write_through:
            self.write(gpu_block, h)

    def on_gpu_evicted(self, gpu_block: int, h: bytes) -> None:
        """No host tier: the GPU pool evicted the block `h` was cached in (write_back)."""
        if not self.write_through:
            self.write(gpu_block, h)

    def on_host_stored(self, host_blocks: list[tuple[int, bytes]]) -> None:
        """Swap-outs into these host blocks were acknowledged (write_through writes them)."""
        if self.write_through:
            for hb, h in host_blocks:
                self.write(hb, h)

    def save_host_victims(self, want: int) -> None:
        """write_back from the host tier: the host pool is about to evict its `want` least
        recently used free blocks. Each holding content whose key is neither stored nor being
        written is pinned and written first (evicted later, once the write is acknowledged),
        and the walk goes on, so `want` blocks that lose nothing are offered when possible."""
        pool = self.host_pool
        if self.write_through or pool is None or want <= 0:
            return
        index, prefix = self.index, self.prefix
        save: list[tuple[int, str]] = []
        takeable = 0
        for b in pool.iter_free():
            h = pool.block_hash[b]
            if h is not None:
                key = prefix + h.hex()
                if key not in index and not index.is_writing(key):
                    save.append((b, key))
                    continue
            takeable += 1
            if takeable >= want:
                break
        for b, key in save:
            index.begin_write(key)
            self._writes.append((key, b, True))
        if save:
            pool.touch([b for b, _ in save])

    # ---- fetches ---------------------------------------------------------------------------
    def fetch(self, handle: int, keys: list[str], gpu_blocks: list[int]) -> None:
        """Queue fetches of stored keys into a placed handle's fresh GPU blocks."""
        for k, g in zip(keys, gpu_blocks, strict=True):
            self._fetches.append((handle, k, g))

    def forget(self, keys: list[str]) -> None:
        """These keys failed to come back (a prefetch): out of the index, a storage
        BlockRemoved each (they may be gone from the store)."""
        index, plen = self.index, len(self.prefix)
        removed = [bytes.fromhex(k[plen:]) for k in keys if k in index]
        index.discard([k for k in keys if k in index])
        events = self._sink.events if self._sink is not None else None
        if events is not None and removed:
            events.append(BlockRemoved(removed, STORAGE))

    def decline(self, n: int) -> None:
        self.stats.fetches_declined += n

    # ---- the message and its acknowledgement ----------------------------------------------
    def has_queued(self) -> bool:
        return bool(self._writes or self._fetches)

    @property
    def num_queued_writes(self) -> int:
        return len(self._writes)

    @property
    def num_queued_fetches(self) -> int:
        return len(self._fetches)

    def take(
        self, dropped_handles: set[int], max_writes: int | None = None
    ) -> tuple[list[tuple[str, int]], list[tuple[int, str, int]]]:
        """The queued tasks for the Tasks message being sealed: writes (key, block) and
        fetches (handle, key, gpu block), without fetches of handles the message drops. At
        most `max_writes` writes of pinned (host) blocks go out (the rest wait, pinned, for the
        next messages: a burst of writes would outlast the step they run beside); writes of GPU
        blocks always go (nothing holds their block). Call `sent(seq)` once the message is
        numbered."""
        writes, fetches = self._writes, self._fetches
        if dropped_handles and fetches:
            fetches = [f for f in fetches if f[0] not in dropped_handles]
        rest: list[tuple[str, int, bool]] = []
        if max_writes is not None and len(writes) > max_writes:
            pinned = [w for w in writes if w[2]]
            if len(pinned) > max_writes:
                keep = {id(w) for w in pinned[:max_writes]}
                rest = [w for w in writes if w[2] and id(w) not in keep]
                writes = [w for w in writes if not w[2] or id(w) in keep]
        self._pending = _Sent(0, writes, [(hnd, k) for hnd, k, _ in fetches])
        self._writes, self._fetches = rest, []
        self.stats.writes += len(writes)
        self.stats.fetches += len(fetches)
        return [(k, b) for k, b, _ in writes], fetches

    def sent(self, seq: int) -> None:
        rec = self._pending
        if rec.writes or rec.fetches:
            rec.seq = seq
            self._sent.append(rec)
        self._pending = _Sent(0)

    def acknowledge(
        self, applied_seq: int, failed_writes: list[str], failed_fetch_handles: list[int]
    ) -> None:
        """The worker applied every message up to `applied_seq`: their writes are stored but
        those named in `failed_writes`; their fetches are done but those of
        `failed_fetch_handles` (whose keys leave the index). Releases the host pins."""
        sent, index = self._sent, self.index
        bad_w = set(failed_writes) if failed_writes else ()
        bad_f = {int(h) for h in failed_fetch_handles} if failed_fetch_handles else ()
        stored: list[bytes] = []
        removed: list[bytes] = []
        unpin: list[int] = []
        evict: list[tuple[int, bytes]] = []  # write_back's host victims, written: evicted now
        n = 0
        plen = len(self.prefix)
        while sent and sent[0].seq <= applied_seq:
            rec = sent.popleft()
            n += len(rec.fetches)
            for key, block, pinned in rec.writes:
                ok = key not in bad_w
                index.end_write(key, ok)
                if ok:
                    h = bytes.fromhex(key[plen:])
                    stored.append(h)
                    if pinned and not self.write_through:
                        evict.append((block, h))
                else:
                    self.stats.write_failures += 1
                if pinned:
                    unpin.append(block)
            for handle, key in rec.fetches:
                if handle in bad_f:
                    self.stats.fetch_failures += 1
                    if key in index:
                        index.discard([key])
                        removed.append(bytes.fromhex(key[plen:]))
        events = self._sink.events if self._sink is not None else None
        if unpin:
            pool = self.host_pool
            assert pool is not None
            pool.free(unpin)
            # A host victim whose write is acknowledged is evicted now, as it would have been
            # without the tier (its content lives on in the store): the host LRU's order stays
            # what it was (freeing it young would keep it over fresher blocks).
            pool.events = events  # a cpu BlockRemoved each
            for b, h in evict:
                if pool.block_hash[b] == h:
                    pool.forget(b)
        if events is not None:
            if stored:
                events.append(BlockStored(stored, None, [], self.block_size, None, STORAGE))
            if removed:
                events.append(BlockRemoved(removed, STORAGE))
        self.fetched_last_ack = n

    def reset(self) -> None:
        """reset_prefix_cache: drop the writes not yet sent (their pins too)."""
        unpin = [b for _, b, pinned in self._writes if pinned]
        for key, _, _ in self._writes:
            self.index.end_write(key, False)
        self.stats.writes_skipped += len(self._writes)
        self._writes = []
        if unpin:
            assert self.host_pool is not None
            self.host_pool.free(unpin)

    def abandon(self) -> None:
        """The instance is gone (its scheduler is dropped): release every write's claim in the
        shared index (none was acknowledged: never stored), so other instances may write those
        keys; nothing else of this tier is used again."""
        for key, _, _ in [*self._writes, *(w for r in self._sent for w in r.writes)]:
            self.index.end_write(key, False)
        self._writes, self._fetches = [], []
        self._sent.clear()

    # ---- figures and checks ----------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return sum(len(r.writes) + len(r.fetches) for r in self._sent)

    def host_pins(self) -> dict[int, int]:
        """Host block -> pins held by writes queued or in flight."""
        pins: dict[int, int] = {}
        recs = [self._writes, *(r.writes for r in self._sent)]
        for writes in recs:
            for _, b, pinned in writes:
                if pinned:
                    pins[b] = pins.get(b, 0) + 1
        return pins

    def check_integrity(self, live_handles: set[int]) -> None:
        """Every write queued or in flight holds its claim in the index; a host block is
        pinned only by writes from a host tier; queued fetches name live handles."""
        keys = [k for k, _, _ in self._writes] + [k for r in self._sent for k, _, _ in r.writes]
        assert len(set(keys)) == len(keys), "a key written twice at once by one instance"
        for k in keys:
            assert self.index.is_writing(k), f"write of {k} holds no claim in the index"
        if self.host_pool is None:
            assert not any(p for _, _, p in self._writes), "a GPU-sourced write pins"
        for hnd, _, _ in self._fetches:
            assert hnd in live_handles, f"fetch queued for handle {hnd}, not live"
