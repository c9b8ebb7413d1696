"""KV-cache events: which block hashes an instance's prefix cache gained and lost, in order.

Pure data, recorded by the block pool and the KV cache manager only when a consumer asked for
them (`Scheduler.enable_kv_events()`; a standalone daemon records nothing) and drained by the
daemon after each step (`Scheduler.take_kv_events()`), which publishes them (docs/CLUSTER.md).
The field names follow vLLM's KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
with `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_name`, `medium`) so
that an external router can read them. `medium` is the tier the blocks live in: "gpu" for now.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    medium: str = "gpu"


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their hashes no longer hit)."""

    block_hashes: list[bytes]
    medium: str = "gpu"


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached hash of the instance was dropped (a prefix-cache reset, a new cache)."""

    medium: str = "gpu"


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
