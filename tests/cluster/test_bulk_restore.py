"""Snapshots applied in bulk (issue 25: a restarted daemon's index back quickly): the holders
built from many snapshots at once equal those added one snapshot at a time, on random indexes
(bounded in size: at most 40 instances, a few thousand keys)."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from kvsched.cluster import hit_index
from kvsched.cluster.hit_index import HitIndex
from kvsched.cluster.kv_index import ClusterIndex, decode, encode_batch, encode_snapshot
from kvsched.cluster.kv_stream import KvStream
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.core.kv_events import CPU, GPU, STORAGE, BlockRemoved, BlockStored

BS = 16


def _parts(rng: random.Random, pool: list[int], slots: int) -> list[tuple[str, int, list[int]]]:
    """Random (medium, slot, keys): keys shared between slots and tiers, some repeated."""
    parts = []
    for slot in rng.sample(range(3 * slots), slots):  # sparse slots: holder ints of many words
        for medium in (GPU, CPU):
            keys = rng.sample(pool, rng.randrange(0, len(pool) // 3))
            parts.append((medium, slot, keys + keys[: rng.randrange(4)]))
    return parts


@pytest.mark.parametrize(
    ("seed", "pool_size", "slots"), [(s, 600, 39) for s in range(4)] + [(9, 40, 5)]
)
def test_add_many_equals_adding_each_part_in_turn(seed: int, pool_size: int, slots: int) -> None:
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(pool_size)]
    before = _parts(rng, pool, 5)  # holders already there (a daemon that knew some instances)
    parts = _parts(rng, pool, slots)
    # Big enough for the grouped (numpy) path, or small: the plain one.
    assert (sum(len(k) for _, _, k in parts) >= hit_index._BULK_MIN) == (pool_size == 600)
    parts.append((STORAGE, 1, pool[:3]))  # storage keys go by `add`, with their namespace
    one, bulk = HitIndex(), HitIndex()
    for idx in (one, bulk):
        for medium, slot, keys in before:
            idx.add(medium, slot, keys)
    for medium, slot, keys in parts:
        if medium != STORAGE:
            one.add(medium, slot, keys)
    bulk.add_many(parts)
    assert bulk.holders == one.holders
    assert bulk.storage == {}


def _hashes(rng: random.Random, pool: list[bytes], k: int) -> list[bytes]:
    return rng.sample(pool, k)


@pytest.mark.parametrize("seed", range(4))
def test_apply_snapshots_equals_applying_them_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    pool = [rng.randbytes(16) for _ in range(2000)]
    load = {"running": 1.0, "waiting": 0.0, "max_num_seqs": 8.0, "kv_usage": 0.1}
    snaps, early = [], []
    n = 30
    for i in range(n):
        iid = f"i{i if i < 20 else rng.randrange(20)}"  # the last 10 again: a second group
        stored = _hashes(rng, pool, rng.randrange(0, 20))
        snaps.append(
            encode_snapshot(
                iid,
                f"d{i % 7}",
                "e",
                5,
                BS,
                load,
                _hashes(rng, pool, rng.randrange(0, 400)),
                host_hashes=_hashes(rng, pool, rng.randrange(100, 600)),
                info={"model": "m"},
                storage_hashes=stored,
            )
        )
        # A batch heard before the snapshot (kept pending, replayed after it): seq 6 > 5.
        gone, new = _hashes(rng, pool, 30), _hashes(rng, pool, 10)
        events = [BlockRemoved(gone, GPU), BlockStored(new, None, [], BS, None, CPU)]
        events.append(BlockRemoved(stored[:2], STORAGE))
        early.append(encode_batch(iid, f"d{i % 7}", "e", 6, 0.0, BS, load, events))
    first = [decode(raw) for raw in snaps[:20]]  # one group: distinct instances
    sizes = [
        len(s.get("packed_block_hashes", "")) + len(s["packed_host_block_hashes"]) for s in first
    ]
    assert sum(sizes) // 32 >= hit_index._BULK_MIN  # its holders are grouped by key (numpy)
    one, bulk = ClusterIndex(), ClusterIndex()
    for idx in (one, bulk):
        for raw in early:
            assert not idx.apply_batch(decode(raw), 1.0)
    for raw in snaps:
        one.apply_snapshot(decode(raw), 2.0)
    bulk.apply_snapshots([decode(raw) for raw in snaps], 2.0)
    assert bulk.digest() == one.digest() and bulk.host_digest() == one.host_digest()
    assert bulk.hits.holders == one.hits.holders and bulk.hits.storage == one.hits.storage
    assert {i: (v.slot, v.seq, v.synced) for i, v in bulk.instances.items()} == {
        i: (v.slot, v.seq, v.synced) for i, v in one.instances.items()
    }
    assert (bulk.version, bulk.num_snapshots) == (one.version, one.num_snapshots)
    assert (bulk.table.heard == one.table.heard).all() and (bulk.table.load == one.table.load).all()
    assert any(v.seq == 6 for v in bulk.instances.values())  # the pending batches replayed


def test_the_index_gives_the_garbage_collector_no_key_container_to_traverse() -> None:
    """A 1,000-instance index holds millions of keys: in containers the collector tracks,
    every full collection traversed them (128-158 ms in bench.router_scale). After snapshots,
    batches that store and remove keys in every tier, and a forgotten instance, no key
    container of the index is tracked."""
    rng = random.Random(3)
    pool = [rng.randbytes(16) for _ in range(300)]
    load = {"running": 1.0, "waiting": 0.0, "max_num_seqs": 8.0, "kv_usage": 0.1}
    idx = ClusterIndex()
    for i in range(6):
        snap = encode_snapshot(
            f"i{i}", "d", "e", 1, BS, load, rng.sample(pool, 100),
            host_hashes=rng.sample(pool, 100), info={"model": "m"},
            storage_hashes=rng.sample(pool, 20),
        )  # fmt: skip
        idx.apply_snapshots([decode(snap)])
        events = [
            BlockStored(rng.sample(pool, 5), None, [], BS, None, GPU),
            BlockRemoved(rng.sample(pool, 5), CPU),
            BlockStored(rng.sample(pool, 5), None, [], BS, None, STORAGE),
        ]
        assert idx.apply_batch(decode(encode_batch(f"i{i}", "d", "e", 2, 0.0, BS, load, events)))
    idx.forget("i0")
    views = list(idx.instances.values())
    assert len(views) == 5 and all(len(v.hashes) and len(v.host) for v in views)
    containers = [v.gpu_keys for v in views] + [v.host_keys for v in views]
    containers += [idx.hits.holders, *idx.hits.storage.values()]
    assert len(idx.hits.stored("m")) >= 20
    assert not [c for c in containers if gc.is_tracked(c)]


def test_a_malformed_snapshot_changes_nothing_of_the_group() -> None:
    good = decode(encode_snapshot("i0", "d", "e", 1, BS, {}, [bytes(16)]))
    bad = {"instance": "i1", "daemon": "d", "epoch": "e", "seq": 1, "block_size": BS}
    bad["packed_block_hashes"] = "zz"  # not hex
    idx = ClusterIndex()
    with pytest.raises(ValueError):
        idx.apply_snapshots([good, bad])
    assert idx.hits.holders == {} and not any(v.hashes for v in idx.instances.values())


def test_kv_stream_applies_snapshots_that_arrive_together_at_once(nats_server: NatsServer) -> None:
    """Snapshots received in one turn of the loop go to the index in one `apply_snapshots`; a
    malformed one fails only its own fetch (the others are applied)."""

    async def go() -> None:
        link = await connect_cluster(nats_server.url, "bulk-sub")
        stream = KvStream(link, dict)
        calls: list[int] = []
        apply = stream.index.apply_snapshots

        def counted(snaps: list[dict], now: float = 0.0) -> None:  # type: ignore[type-arg]
            calls.append(len(snaps))
            apply(snaps, now)

        stream.index.apply_snapshots = counted  # type: ignore[method-assign]
        snaps = [
            decode(encode_snapshot(f"i{k}", "d", "e", 1, BS, {}, [bytes([k]) * 16]))
            for k in range(3)
        ]
        snaps[1]["packed_block_hashes"] = "zz"  # not hex
        got = await asyncio.wait_for(
            asyncio.gather(*(stream._apply_snapshot(s) for s in snaps), return_exceptions=True),
            10,
        )
        await link.close()
        assert got[0] is None and got[2] is None and isinstance(got[1], ValueError)
        assert calls == [3, 1, 1, 1]  # the three together, then (one was malformed) each alone
        assert set(stream.index.digest()) == {"i0", "i2"}

    asyncio.run(go())
