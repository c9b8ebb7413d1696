"""A restarted (or late) daemon learns the shared storage tier's contents from its peers'
snapshots, not only from storage events written after it started (issue 25: "a restarted
daemon's index is back to 99 % of its warm hits within 2 s (snapshots)")."""

from __future__ import annotations

import asyncio
import os
import time

from kvsched.cluster.hit_index import keys_of
from kvsched.cluster.kv_index import decode, encode_snapshot
from kvsched.cluster.kv_stream import SNAPSHOT_STORAGE_KEYS, KvStream, snapshot_hex
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.core.storage import StorageIndex
from tests.cluster.test_tier_index import BS, host_sched, prompts, serve


def test_recent_keys_are_newest_first_within_a_namespace_and_bounded() -> None:
    idx = StorageIndex()
    idx.add([f"m/16/{i:032x}" for i in range(5)])
    idx.add(["other/16/" + "ab" * 16])
    idx.add(["m/16/" + f"{1:032x}"])  # stored again: newest now
    assert idx.recent("m/16/", 3) == [f"m/16/{i:032x}" for i in (1, 4, 3)]
    assert idx.recent("m/16/", 0) == []
    assert idx.recent("m/32/", 10) == []


def test_snapshot_hash_lists_round_trip_as_hex_packed_or_not() -> None:
    hashes = [os.urandom(16) for _ in range(4)]
    snap = decode(encode_snapshot("i", "d", "e", 0, BS, {}, [], storage_hashes=hashes))
    assert snapshot_hex(snap, "storage_block_hashes") == [h.hex() for h in hashes]
    odd = [b"\x01\x02", b"\x03"]  # not 16 bytes each: listed, not packed
    snap = decode(encode_snapshot("i", "d", "e", 0, BS, {}, [], storage_hashes=odd))
    assert snapshot_hex(snap, "storage_block_hashes") == [h.hex() for h in odd]


def test_late_daemon_learns_the_stores_keys_from_a_snapshot(nats_server: NatsServer) -> None:
    async def go() -> None:
        sched = host_sched()
        pub_link = await connect_cluster(nats_server.url, "st-pub")
        late_link = await connect_cluster(nats_server.url, "st-late")
        pub = KvStream(pub_link, lambda: {"s0": sched})
        late = KvStream(late_link, dict)
        pub.info_of = late.info_of = lambda iid: {"model": "m"}
        pub.storage_index, late.storage_index = StorageIndex(), StorageIndex()
        # What the publishing daemon's instances wrote to the store before `late` started
        # (no storage event will ever repeat them), plus a key of another model.
        stored = [os.urandom(16) for _ in range(SNAPSHOT_STORAGE_KEYS + 10)]
        pub.storage_index.add(f"m/{BS}/{h.hex()}" for h in stored)
        pub.storage_index.add([f"other/{BS}/" + "cd" * 16])
        await pub.start(publish_every_flush_s=False)
        try:
            serve(sched, prompts(1, seed=3)[0])
            await pub.flush()
            await late.start(publish_every_flush_s=False)
            serve(sched, prompts(1, seed=4)[0])  # a batch `late` sees first: it asks a snapshot
            want = {f"m/{BS}/{h.hex()}" for h in stored[-SNAPSHOT_STORAGE_KEYS:]}
            deadline = time.monotonic() + 10
            while not want <= set(late.storage_index):
                assert time.monotonic() < deadline, "late daemon never learnt the stored keys"
                await pub.flush()
                await asyncio.sleep(0.05)
            # The newest SNAPSHOT_STORAGE_KEYS of the instance's namespace, nothing else.
            assert set(late.storage_index) == want
            # Its cluster index routes on them too: the storage set of model "m".
            assert late.index.hits.stored("m") >= set(keys_of(stored[-SNAPSHOT_STORAGE_KEYS:]))
        finally:
            for x in (pub, late):
                await x.stop()
            for link in (pub_link, late_link):
                await link.close()

    asyncio.run(go())
