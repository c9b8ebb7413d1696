"""Per-request block tables and the prefix cache, over a BlockPool.

A block's hash chains its parent's hash, its token ids and its extra keys, so equal hashes mean
equal prefixes (`block_hash.BlockHasher`, which draws the chain). Only full blocks are hashed,
and a block is registered in the cache only after the worker has reported writing it
(`cache_reported`), never when it is merely scheduled: a reader put into the same step as the
writer would read KV that is not there yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvsched.core.block_hash import BlockHasher
from kvsched.core.block_pool import BlockPool
from kvsched.core.config import WritePolicy
from kvsched.core.kv_events import BlockStored
from kvsched.core.prefetch import Prefetcher
from kvsched.core.request import Request
from kvsched.core.storage import StorageIndex, StorageTier
from kvsched.core.tiers import HostTier


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KvHit(NamedTuple):
    """What the cache holds of a request's prompt (`KVCacheManager.lookup`): the GPU blocks of
    its longest cached prefix, then the host blocks continuing that run (swap-in candidates),
    then the storage keys continuing it (fetch candidates)."""

    gpu: list[int]
    host: list[int]
    storage: list[str]


def reads_prompt(req: Request) -> bool:
    """Whether req's sampling reads its prompt's token ids (a repetition penalty does, as in
    vLLM): the worker learns a prompt's tokens only from the chunks it computes, so such a
    request takes no prefix hit and sends its whole prompt (correct, at the cost of the
    recompute). Its blocks are still cached for others. So does a structured-output request
    placed again after outputs: a worker that must rebuild its grammar replays those outputs
    (the prompt's end) into it. A request asking for prompt log-probabilities computes its
    whole prompt too (vLLM's scheduler skips the prefix cache for it: the log-probabilities
    come from the prompt's forward pass)."""
    sp = req.sampling
    return (
        sp.repetition_penalty != 1.0
        or sp.prompt_logprobs is not None
        or (sp.structured is not None and bool(req.output_token_ids))
    )


def prefills_at_once(req: Request) -> bool:
    """Whether req's prompt must be computed in one step: it still awaits its prompt
    log-probabilities. The worker learns a prompt's tokens only from the chunks it is sent, and
    the log-probability at a chunk's last position is that of the next chunk's first token (a
    chunk boundary would leave it unknown). Validation refuses such a prompt longer than a
    step's token budget."""
    lp = req.logprobs
    return lp is not None and lp.prompt is None and req.sampling.prompt_logprobs is not None


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        host_write_policy: WritePolicy = WritePolicy.WRITE_BACK,
        host_write_hits: int = 1,
        storage: StorageIndex | None = None,
        storage_namespace: str = "",
        storage_write_policy: WritePolicy = WritePolicy.WRITE_BACK,
        storage_prefetch: bool = False,
    ) -> None:
        """storage_prefetch: get a queued request's storage hits into host blocks while it
        waits (core/prefetch.py; needs both tiers)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # The host tier (none without host blocks or prefix caching: then nothing changes).
        self.host: HostTier | None = None
        self._on_registered = None
        if num_host_blocks and enable_caching:
            self.host = HostTier(num_host_blocks, num_blocks, host_write_policy, host_write_hits)
            self.pool.on_evict = self.host.on_evicted
            self.host.events_into(self.pool, block_size)
            self._on_registered = self.host.on_registered
        self.num_host_hits = 0  # prefix-cache hit tokens that came from the host tier
        # The storage tier (core/storage.py): the daemon's shared index, this instance's tasks.
        self.storage: StorageTier | None = None
        if storage is not None and enable_caching:
            through = WritePolicy(storage_write_policy) is WritePolicy.WRITE_THROUGH
            host_pool = self.host.pool if self.host is not None else None
            st = StorageTier(storage, storage_namespace, block_size, through, host_pool)
            st.events_into(self.pool)
            if self.host is not None:
                self.host.use_storage(st)
            elif through:
                self._on_registered = st.on_gpu_registered
            else:
                self.pool.on_evict = st.on_gpu_evicted
            self.storage = st
        self.num_storage_hits = 0  # prefix-cache hit tokens fetched from the storage tier
        self.prefetch: Prefetcher | None = None
        if storage_prefetch and self.host is not None and self.storage is not None:
            self.prefetch = Prefetcher(self.host, self.storage)
            self.host.relieve = self.prefetch.relieve
            self.host.prefetch_pins = self.prefetch.host_pins
        self.num_prefetched_hits = 0  # of num_storage_hits: prefetched before placement
        self.hasher = BlockHasher(block_size)  # only full blocks are hashed
        # Prefix-cache statistics, in tokens (as vLLM's prefix_cache_queries / _hits).
        self.num_queries = 0
        self.num_hits = 0

    # ---- hashing (`block_hash.BlockHasher`) -----------------------------------------------
    def block_extra_keys(self, req: Request, i: int) -> bytes:
        return self.hasher.block_extra_keys(req, i)

    def hash_block(self, parent: bytes, tokens: list[int], extra: bytes) -> bytes:
        return self.hasher.hash_block(parent, tokens, extra)

    def ensure_hashes(self, req: Request, num_blocks: int) -> None:
        """Extend req.block_hashes to cover its first `num_blocks` full blocks (tokens known)."""
        self.hasher.ensure_hashes(req, num_blocks)

    # ---- lookup and allocation ------------------------------------------------------------
    def lookup(self, req: Request) -> KvHit:
        """The longest cached prefix of req's tokens: GPU blocks, then the host blocks that
        continue the run. A full hit is capped so at least the last token is computed (the
        worker needs its logits). Changes nothing but req's hashes. A request whose sampling
        reads its prompt's tokens (`reads_prompt`) takes no hit."""
        if not self.enable_caching or reads_prompt(req):
            return KvHit([], [], [])
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self.hasher.ensure_hashes(req, max_blocks)
        hits: list[int] = []
        lookup = self.pool.cached.get
        hashes = req.block_hashes[:max_blocks]
        for h in hashes:
            b = lookup(h)
            if b is None:
                break
            hits.append(b)
        host = self.host.run_from(hashes[len(hits) :]) if self.host is not None else []
        st = self.storage
        stored = st.run_from(hashes[len(hits) + len(host) :]) if st is not None else []
        return KvHit(hits, host, stored)

    def hit_tokens(self, req: Request) -> int:
        """Tokens of req's prompt this cache holds now in either tier (for routing and
        predictions); no side effects but req's hashes."""
        if not self.enable_caching or reads_prompt(req):
            return 0
        self.hasher.ensure_hashes(req, (req.num_tokens - 1) // self.block_size)
        lookup = self.pool.cached.get
        n = 0
        for h in req.block_hashes:
            if lookup(h) is None:
                break
            n += 1
        if self.host is not None:  # the run continues in host memory (swapped in)
            n += len(self.host.run_from(req.block_hashes[n:]))
        if self.storage is not None:  # then in the storage tier (fetched)
            n += len(self.storage.run_from(req.block_hashes[n:]))
        return n * self.block_size

    def tier_hit_tokens(self, req: Request) -> tuple[int, int]:
        """(GPU, host) prompt tokens of req's longest cached run (`hit_tokens` split by tier:
        the GPU prefix, then its continuation in host memory); no side effects but hashes."""
        if not self.enable_caching or reads_prompt(req):
            return 0, 0
        self.hasher.ensure_hashes(req, (req.num_tokens - 1) // self.block_size)
        lookup, n = self.pool.cached.get, 0
        for h in req.block_hashes:
            if lookup(h) is None:
                break
            n += 1
        host = len(self.host.run_from(req.block_hashes[n:])) if self.host is not None else 0
        return n * self.block_size, host * self.block_size

    def tier_hits(self, req: Request) -> tuple[int, int, int]:
        """(GPU, host, storage) prompt tokens of req's longest cached run; no side effects but
        hashes (`tier_hit_tokens` with the storage tier's continuation)."""
        gpu, host = self.tier_hit_tokens(req)
        st = self.storage
        if st is None or not self.enable_caching or reads_prompt(req):
            return gpu, host, 0
        start = (gpu + host) // self.block_size
        return gpu, host, len(st.run_from(req.block_hashes[start:])) * self.block_size

    def where(self, block_hash: bytes) -> tuple[int | None, int | None]:
        """The prefix index over both tiers: (GPU block, host block) holding this content."""
        host = self.host.lookup(block_hash) if self.host is not None else None
        return self.pool.lookup(block_hash), host

    def record_lookup(
        self,
        num_query_tokens: int,
        num_hit_tokens: int,
        num_host_hit_tokens: int = 0,
        num_storage_hit_tokens: int = 0,
        num_prefetched_tokens: int = 0,
    ) -> None:
        """num_hit_tokens counts hits in any tier; num_host_hit_tokens those from host,
        num_storage_hit_tokens those from the storage tier (fetched on the step, or
        num_prefetched_tokens of them prefetched into host blocks before placement)."""
        self.num_prefetched_hits += num_prefetched_tokens
        self.num_queries += num_query_tokens
        self.num_hits += num_hit_tokens
        self.num_host_hits += num_host_hit_tokens
        self.num_storage_hits += num_storage_hit_tokens

    def num_blocks_to_allocate(self, req: Request, num_tokens: int, hits: list[int]) -> int:
        """Blocks, counting hits that must leave the free list, needed so req's table covers
        `num_tokens` positions."""
        have = len(req.block_ids) + len(hits)
        need = max(0, _cdiv(num_tokens, self.block_size) - have)
        ref = self.pool.ref_cnt
        return need + sum(1 for b in hits if ref[b] == 0)

    def allocate_slots(
        self, req: Request, num_tokens: int, hits: list[int] | None = None
    ) -> list[int] | None:
        """Make req's block table cover positions [0, num_tokens): first take the prefix `hits`
        (ref counted, leave the free list), then fresh blocks. Returns the new fresh block ids
        (possibly empty), or None, changing nothing, when the pool cannot supply them."""
        hits = hits or []
        bs = self.block_size
        need = max(0, _cdiv(num_tokens, bs) - len(req.block_ids) - len(hits))
        pool = self.pool
        if need + sum(1 for b in hits if pool.ref_cnt[b] == 0) > pool.num_free:
            return None
        if hits:
            pool.touch(hits)
            req.block_ids.extend(hits)
            req.num_cached_blocks = len(req.block_ids)
            if self.host is not None:
                self.host.on_gpu_hits(hits, [pool.block_hash[b] for b in hits])
        new = pool.allocate(need) if need else []
        assert new is not None
        req.block_ids.extend(new)
        return new

    def cache_reported(self, req: Request) -> None:
        """Register req's full blocks that the worker has reported written."""
        if not self.enable_caching:
            return
        ids = req.block_ids
        n = min(req.num_reported_tokens // self.block_size, len(ids))
        start = req.num_cached_blocks
        if n <= start:
            return
        self.hasher.ensure_hashes(req, n)
        hashes = req.block_hashes
        n = min(n, len(hashes))
        block_hash, cached = self.pool.block_hash, self.pool.cached
        on_registered = self._on_registered
        events = self.pool.events
        first = -1  # the first block this call registered (events only)
        for i in range(start, n):
            b, h = ids[i], hashes[i]
            # A block already holding a hash is a prefix hit; content another block already
            # holds is not registered twice (BlockPool.cache_block, inlined: decode visits).
            if block_hash[b] is None and cached.setdefault(h, b) == b:
                block_hash[b] = h
                if on_registered is not None:
                    on_registered(b, h)  # the host tier's write policy
                if first < 0:
                    first = i
        req.num_cached_blocks = n
        if events is not None and first >= 0:
            # One chain from the first new block on (blocks in it already cached elsewhere
            # are stored again: harmless for a consumer, and keeps the chain whole).
            bs = self.block_size
            events.append(
                BlockStored(
                    hashes[first:n],
                    hashes[first - 1] if first else None,
                    req.token_ids(first * bs, n * bs),
                    bs,
                    req.lora_name or None,
                )
            )

    def extend_blocks(self, req: Request, n: int) -> list[int] | None:
        """Append n fresh blocks to req's table; None, changing nothing, when the pool has
        fewer free."""
        new = self.pool.allocate(n)
        if new is not None:
            req.block_ids.extend(new)
        return new

    def free(self, req: Request) -> None:
        """Return req's blocks, chain tail first, and clear its table."""
        ids = req.block_ids
        ids.reverse()
        self.pool.free(ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_cache(self, placed: Iterable[Request] = ()) -> int:
        """Forget every cached hash in both tiers (the shared store keeps its keys: they name
        content; writes not yet sent are dropped); the `placed` requests' blocks are never
        registered again (their old content). Returns how many were dropped."""
        for req in placed:
            req.num_cached_blocks = len(req.block_ids)
        n = self.pool.reset_cache()
        if self.host is not None:
            n += self.host.reset()
        if self.storage is not None:
            self.storage.reset()
        return n

    # ---- the host-copy sequence (swap-outs and swap-ins carried by Tasks messages) ----------
    def swap_in(self, handle: int, host_blocks: list[int], gpu_blocks: list[int]) -> None:
        """Queue swap-ins of pinned host blocks into a placed handle's fresh GPU blocks."""
        assert self.host is not None
        self.host.copy_in(handle, host_blocks, gpu_blocks)

    def pin_host(self, host_blocks: list[int]) -> None:
        """Hold host hits before an allocation can evict them (then `swap_in`)."""
        assert self.host is not None
        self.host.pin(host_blocks)

    def decline_swap_ins(self, n: int) -> None:
        """n host hits were recomputed instead (cheaper than copying, by the cost model)."""
        if self.host is not None:
            self.host.stats.swap_ins_declined += n

    @property
    def num_queued_copies(self) -> int:
        """Copies the next Tasks message is expected to carry (0 without a host tier)."""
        return self.host.num_queued if self.host is not None else 0

    @property
    def num_queued_fetches(self) -> int:
        """Storage fetches the next Tasks message carries (0 without a storage tier)."""
        return self.storage.num_queued_fetches if self.storage is not None else 0

    def take_copies(
        self, dropped: list[int], aborted: list[int]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]] | None:
        """The copies for the Tasks message being sealed (None: none queued), without swap-ins
        of the handles it drops (`dropped` preempts, `aborted` aborts)."""
        host = self.host
        if host is None or not host.has_queued():
            return None
        return host.take({*dropped, *aborted})

    def copies_sent(self, seq: int) -> None:
        """The copies `take_copies` returned went out in Tasks message `seq`."""
        if self.host is not None:
            self.host.sent(seq)

    def acknowledge_copies(
        self, applied_seq: int, failed_outs: list[int], failed_in_handles: list[int]
    ) -> int:
        """A report says Tasks up to applied_seq were applied: their copies are done (but the
        failed ones). Returns the copies done at that step's boundary (the cost model's term)."""
        host = self.host
        assert host is not None
        host.acknowledge(applied_seq, failed_outs, failed_in_handles)
        return host.swapped_last_ack

    # ---- the storage tier's tasks (writes and fetches carried by Tasks messages) -----------
    def fetch(self, handle: int, keys: list[str], gpu_blocks: list[int]) -> None:
        """Queue fetches of stored keys into a placed handle's fresh GPU blocks."""
        assert self.storage is not None
        self.storage.fetch(handle, keys, gpu_blocks)

    # ---- storage -> host prefetch (core/prefetch.py) --------------------------------------
    def prefetch_for(self, req: Request, now: float = 0.0) -> int:
        """Start getting req's storage hits into host blocks (it waits in the queue). Returns
        the blocks queued (0: no prefetcher, none stored, or already prefetching)."""
        pf = self.prefetch
        if pf is None or pf.has(req):
            return 0
        gpu, host, stored = self.lookup(req)
        if not stored:
            return 0
        start = len(gpu) + len(host)
        return pf.issue(req, host, req.block_hashes[start : start + len(stored)], now)

    def release_prefetch(self, req: Request, taken: int = 0) -> None:
        """req was placed (taking `taken` prefetched blocks as host hits) or is gone."""
        if self.prefetch is not None:
            self.prefetch.release(req, taken)

    def take_prefetches(self) -> tuple[list[str], list[int]] | None:
        pf = self.prefetch
        if pf is None or not pf.has_queued():
            return None
        return pf.take()

    def prefetches_sent(self, seq: int) -> None:
        if self.prefetch is not None:
            self.prefetch.sent(seq)

    def acknowledge_prefetches(self, applied_seq: int, failed_host_blocks: list[int]) -> None:
        if self.prefetch is not None:
            self.prefetch.acknowledge(applied_seq, failed_host_blocks)

    def decline_fetches(self, n: int) -> None:
        """n storage hits were recomputed instead (cheaper than fetching, by the cost model)."""
        if self.storage is not None:
            self.storage.decline(n)

    def take_storage(
        self, dropped: list[int], aborted: list[int], max_writes: int | None = None
    ) -> tuple[list[tuple[str, int]], list[tuple[int, str, int]]] | None:
        """The storage tasks for the Tasks message being sealed (None: none queued), without
        fetches of the handles it drops; at most max_writes writes of host blocks."""
        st = self.storage
        if st is None or not st.has_queued():
            return None
        return st.take({*dropped, *aborted}, max_writes)

    def storage_sent(self, seq: int) -> None:
        if self.storage is not None:
            self.storage.sent(seq)

    def acknowledge_storage(
        self, applied_seq: int, failed_writes: list[str], failed_fetch_handles: list[int]
    ) -> int:
        """A report says Tasks up to applied_seq were applied: their storage tasks are done
        (but the failed ones). Returns the fetches done at that step's boundary."""
        st = self.storage
        assert st is not None
        st.acknowledge(applied_seq, failed_writes, failed_fetch_handles)
        return st.fetched_last_ack
