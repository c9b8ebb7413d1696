"""Per-request block tables and the prefix cache, over a BlockPool.

A block's hash chains its parent's hash, its token ids and its extra keys, so equal hashes mean
equal prefixes:

    h[i] = blake2b(h[i-1] | tokens[i*bs : (i+1)*bs] | extra_keys(i))
    extra_keys(i) = LoRA name, cache_salt (block 0 only), and for every multimodal range
                    overlapping the block: (content hash, block start - range offset)

Only full blocks are hashed, and a block is registered in the cache only after the worker has
reported writing it (`cache_reported`), never when it is merely scheduled: a reader put into
the same step as the writer would read KV that is not there yet.
"""

from __future__ import annotations

import hashlib
import struct

from kvsched.core.block_pool import BlockPool
from kvsched.core.config import WritePolicy
from kvsched.core.kv_events import BlockStored
from kvsched.core.request import Request
from kvsched.core.tiers import HostTier


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        host_write_policy: WritePolicy = WritePolicy.WRITE_BACK,
        host_write_hits: int = 1,
    ) -> None:
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
        # Only full blocks are hashed: one precompiled packer (faster than array().tobytes()).
        self._pack_block = struct.Struct(f"<{block_size}q").pack
        # Prefix-cache statistics, in tokens (as vLLM's prefix_cache_queries / _hits).
        self.num_queries = 0
        self.num_hits = 0

    # ---- hashing --------------------------------------------------------------------------
    def block_extra_keys(self, req: Request, i: int) -> bytes:
        if not (req.lora_name or req.cache_salt or req.mm_ranges):
            return b""  # the common case, on the decode hot path
        bs = self.block_size
        start, end = i * bs, (i + 1) * bs
        parts = []
        if req.lora_name:
            parts.append(f"lora={req.lora_name}")
        if i == 0 and req.cache_salt:
            parts.append(f"salt={req.cache_salt}")
        for r in req.mm_ranges:
            if r.offset < end and r.offset + r.length > start:
                parts.append(f"mm={r.content_hash}@{start - r.offset}")
        return "\x1f".join(parts).encode()

    def hash_block(self, parent: bytes, tokens: list[int], extra: bytes) -> bytes:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(self._pack_block(*tokens))
        h.update(extra)
        return h.digest()

    def ensure_hashes(self, req: Request, num_blocks: int) -> None:
        """Extend req.block_hashes to cover its first `num_blocks` full blocks (tokens known)."""
        bs, hashes = self.block_size, req.block_hashes
        p = len(req.prompt_token_ids)
        num_blocks = min(num_blocks, (p + len(req.output_token_ids)) // bs)
        k = len(hashes)
        if k >= num_blocks:
            return
        if not (req.lora_name or req.cache_salt or req.mm_ranges):
            # No extra keys (the common case, and the decode path): a tight loop. Output blocks
            # a placed request decoded lately are read from its slot's ring as packed bytes
            # (the same bytes `pack` makes), without touching 64 Python ints per block.
            parent = hashes[-1] if hashes else b""
            blake2b = hashlib.blake2b
            data = None
            if req._rows is not None and k * bs >= p:
                data = req._rows.packed(req, k * bs - p, num_blocks * bs - p)
            if data is None:
                pack = self._pack_block
                tokens = req.token_ids(k * bs, num_blocks * bs)
                data = b"".join([pack(*tokens[j : j + bs]) for j in range(0, len(tokens), bs)])
            width = 8 * bs  # bytes per block
            for j in range(0, len(data), width):
                parent = blake2b(parent + data[j : j + width], digest_size=16).digest()
                hashes.append(parent)
            return
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            tokens = req.token_ids(i * bs, (i + 1) * bs)
            hashes.append(self.hash_block(parent, tokens, self.block_extra_keys(req, i)))

    # ---- lookup and allocation ------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the longest cached prefix of req's tokens. A full hit is capped so at least
        the last token is computed (the worker needs its logits). Counts queries and hits."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self.ensure_hashes(req, max_blocks)
        hits: list[int] = []
        lookup = self.pool.cached.get
        for h in req.block_hashes[:max_blocks]:
            b = lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def find_host_run(self, req: Request, start: int) -> list[int]:
        """Host blocks continuing req's cached prefix after its first `start` blocks (the GPU
        hits), capped like find_cached_prefix. [] without a host tier."""
        if self.host is None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.host.run_from(req.block_hashes[start:max_blocks])

    def where(self, block_hash: bytes) -> tuple[int | None, int | None]:
        """The prefix index over both tiers: (GPU block, host block) holding this content."""
        host = self.host.lookup(block_hash) if self.host is not None else None
        return self.pool.lookup(block_hash), host

    def record_lookup(
        self, num_query_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        """num_hit_tokens counts hits in either tier; num_host_hit_tokens those from host."""
        self.num_queries += num_query_tokens
        self.num_hits += num_hit_tokens
        self.num_host_hits += num_host_hit_tokens

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
        self.ensure_hashes(req, n)
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

    def reset_cache(self) -> int:
        """Forget every cached hash in both tiers. Returns how many were dropped."""
        n = self.pool.reset_cache()
        if self.host is not None:
            n += self.host.reset()
        return n
