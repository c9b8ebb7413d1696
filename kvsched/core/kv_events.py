"""KV-cache events: which block hashes an instance's prefix cache gained and lost, in order.

Pure data, recorded by the block pool and the KV cache manager only when a consumer asked for
them (`Scheduler.enable_kv_events()`; a standalone daemon records nothing) and drained by the
daemon after each step (`Scheduler.take_kv_events()`), which publishes them (docs/CLUSTER.md).
The field names follow vLLM's KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
with `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_name`, `medium`) so
that an external router can read them. `medium` is the tier the blocks live in: `GPU` (the
instance's GPU pool), `CPU` (its host-memory tier: a block copied GPU -> host is a cpu
BlockStored once the copy is acknowledged, a host eviction a cpu BlockRemoved) or `STORAGE`
(reserved for a store shared by every instance; nothing records it yet). A cpu BlockStored
carries the hashes only (token_ids empty, parent None): the chain was stored as gpu first.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU = "gpu"
CPU = "cpu"
STORAGE = "storage"
MEDIA = (GPU, CPU, STORAGE)  # fastest first: a prefix hit runs GPU, then host, then storage


@dataclass(slots=True)
class BlockStored:
    """Full blocks registered in the prefix cache, a chain: block_hashes[0]'s parent is
    parent_block_hash (None: the first block of a prompt), each next block's parent the one
    before. token_ids: the blocks' tokens, len(block_hashes) * block_size of them."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = GPU


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their hashes no longer hit)."""

    block_hashes: list[bytes]
    medium: str = GPU


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached hash of the instance was dropped (a prefix-cache reset, a new cache)."""

    medium: str = GPU


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
