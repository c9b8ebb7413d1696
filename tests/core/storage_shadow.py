"""A shadow storage tier for tests/core/test_state_machine.py: the real WorkerEngine's storage
tasks (`StorageTasks`, kvsched/worker_stub/storage_kv.py) run against an in-memory store over
the CheckedSim's shadow KV, so a write stores the chain values the block holds (host block
when the instance has a host tier, else GPU block) and a fetch puts them back into the fresh
GPU block, written by the fetching handle; a prefetch puts them into a host block. Some batches fail (writes all, fetches part-way: the
store lost a key), to exercise failed writes and failed fetches."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvsched.worker_stub.storage_kv import StorageTasks, StoreLink

URL = "mooncake://shadow:1"


class ShadowStore:
    """The `BlockStore` the worker's StoreLink connects to: a dict; every `fail_every`-th put
    batch fails, and every `fail_every`-th get batch has lost its last key."""

    def __init__(self, fail_every: int | None) -> None:
        self.url = URL
        self.data: dict[str, bytes] = {}
        self.fail_every = fail_every
        self._puts = self._gets = 0

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]:
        self._puts += 1
        if self.fail_every and self._puts % self.fail_every == 0:
            return list(keys)
        self.data.update(zip(keys, values, strict=True))
        return []

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._gets += 1
        out = [self.data.get(k) for k in keys]
        if self.fail_every and self._gets % self.fail_every == 0 and out:
            self.data.pop(keys[-1], None)  # evicted by the store
            out[-1] = None
        return out

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ShadowBlocks:
    """The executor side of storage tasks over a CheckedSim's shadow KV (`storage_read` /
    `storage_write`, as the model executor has)."""

    def __init__(self, sim: Any, block: int, from_host: bool) -> None:
        self.sim, self.block, self.from_host = sim, block, from_host
        self.fetch_owner: dict[int, int] = {}  # GPU block -> handle fetching into it

    def storage_read(self, block_ids: list[int]) -> list[bytes]:
        src = self.sim.host if self.from_host else self.sim.kv
        return [
            json.dumps([src.get((b, j)) for j in range(self.block)]).encode() for b in block_ids
        ]

    def storage_write(self, gpu_ids: list[int], blobs: list[bytes | None]) -> None:
        self.sim.flush_forget()  # the message's fresh blocks hold garbage from here on
        for g, blob in zip(gpu_ids, blobs, strict=True):
            assert blob is not None
            for j, value in enumerate(json.loads(blob)):
                if value is None:
                    self.sim.kv.pop((g, j), None)
                else:
                    self.sim.kv[(g, j)] = value
                self.sim.writer[(g, j)] = self.fetch_owner[g]

    def storage_write_host(self, host_ids: list[int], blobs: list[bytes | None]) -> None:
        """A storage -> host prefetch: the stored chain values into host blocks."""
        for hb, blob in zip(host_ids, blobs, strict=True):
            assert blob is not None
            for j, value in enumerate(json.loads(blob)):
                self.sim.host[(hb, j)] = value


def attach(
    worker: Any, sim: Any, block: int, from_host: bool, fail_every: int | None
) -> tuple[ShadowStore, ShadowBlocks]:
    """Give `worker` (a WorkerEngine) storage tasks over the shadow; returns the store and
    the executor side (whose fetch_owner the harness sets per message)."""
    store = ShadowStore(fail_every)
    blocks = ShadowBlocks(sim, block, from_host)
    link = StoreLink(connect=lambda url: store)
    link.use(URL)
    worker.storage = StorageTasks(blocks, link)
    return store, blocks
