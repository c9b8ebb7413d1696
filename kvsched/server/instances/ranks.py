"""One instance's worker ranks as the daemon sees them: a connected rank (`RankConn`, one
worker process of a tensor-parallel instance) and the rule a rank joining an instance must
meet (`check_joining_rank`: its world size, its rank's place, and the same sizes, model and
limits as the ranks already there)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsched.core import ProtocolError


@dataclass(slots=True, eq=False)
class RankConn:
    """One connected worker process (one TP rank) of an instance."""

    rank: int
    num_gpu_blocks: int
    block_size: int
    num_slots: int
    address: str
    model: str
    num_host_blocks: int = 0  # the host-memory KV tier (Hello.num_host_blocks)
    max_model_len: int = 0  # Hello's limits (0: not announced); see server/instances/models.py
    vocab_size: int = 0
    storage_backends: tuple[str, ...] = ()  # Hello.storage_backends (step 13)
    # Hello.lora_adapters as (name, path) pairs, and its adapter slots (0: none announced).
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0
    max_cpu_loras: int = 0
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    last_seen: float = field(default_factory=time.monotonic)
    closed: bool = False
    # InstanceRegistry.send_heartbeats: the Tasks count last seen, and since when.
    hb_mark: int = -1
    hb_since: float = field(default_factory=time.monotonic)


def check_joining_rank(
    conn: RankConn, world_size: int, expected: int, ranks: Mapping[int, RankConn], instance_id: str
) -> None:
    """ProtocolError naming what is wrong when `conn` (saying `world_size`) cannot join the
    instance `instance_id` of world size `expected` whose ranks so far are `ranks`."""
    if world_size != expected:
        raise ProtocolError(
            f"instance {instance_id!r} has world size {expected}, "
            f"but rank {conn.rank} says {world_size}"
        )
    if not 0 <= conn.rank < expected:
        raise ProtocolError(f"rank {conn.rank} is outside world size {expected}")
    if conn.rank in ranks:
        raise ProtocolError(f"rank {conn.rank} of instance {instance_id!r} is already connected")
    first = next(iter(ranks.values()), None)
    if first is not None:
        # The ranks run one model sharded: one block table, one slot table, the same
        # weights. A disagreement is a misconfigured launch, never something to average.
        for name in (
            "block_size",
            "num_gpu_blocks",
            "num_host_blocks",
            "num_slots",
            "model",
            "max_model_len",
            "vocab_size",
            "lora_adapters",
            "max_loras",
        ):
            mine, theirs = getattr(conn, name), getattr(first, name)
            if mine != theirs:
                raise ProtocolError(
                    f"rank {conn.rank} says {name} = {mine!r}, rank {first.rank} says "
                    f"{theirs!r}: all ranks of instance {instance_id!r} must agree"
                )
