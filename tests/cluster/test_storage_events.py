"""Peers' storage KV events feed a daemon's shared storage index (cluster/kv_stream.py
`learn_storage`): a write acknowledged on one daemon's instance becomes a storage hit on
another daemon's instance; a failed fetch there takes the key out everywhere. Real schedulers,
the real wire format (kv_index.encode_batch / decode); no NATS needed for the glue itself."""

from __future__ import annotations

from kvsched.cluster.kv_index import decode, encode_batch
from kvsched.cluster.kv_stream import learn_storage
from kvsched.core import Scheduler, StorageIndex
from kvsched.core.kv_events import STORAGE
from tests.core.factories import make_config, make_request
from tests.core.test_storage_tier import BS, FILL, A, drain, run_to_end, work


def publish(s: Scheduler, model: str, daemon: str = "a") -> bytes:
    """One batch of `s`'s KV events as its daemon would publish it."""
    info = {"model": model, "max_model_len": 8192, "vocab_size": 0}
    return encode_batch("i0", daemon, "e", 1, 0.0, BS, {}, s.take_kv_events(), info)


def sched(index: StorageIndex) -> Scheduler:
    cfg = make_config(block_size=BS, num_gpu_blocks=8, prealloc_threshold=0, prealloc_blocks=1)
    return Scheduler(cfg, instance_id="i0", storage=index, storage_namespace="m")


def test_a_peer_daemons_write_is_a_storage_hit_here_and_a_failed_fetch_removes_it() -> None:
    mine, theirs = StorageIndex(), StorageIndex()  # two daemons, one store
    peer, local = sched(theirs), sched(mine)
    peer.enable_kv_events()
    a = make_request(A + [1], max_tokens=1)
    run_to_end(peer, a)
    run_to_end(peer, make_request(FILL, max_tokens=1))  # a's blocks written to the store
    batch = decode(publish(peer, "m"))
    assert any(e["medium"] == STORAGE for e in batch["events"])
    learn_storage(mine, batch)
    assert peer.kv.storage is not None
    keys = peer.kv.storage.keys(a.block_hashes[:3])
    assert mine.run_from(keys) == keys
    b = make_request(A + [2], max_tokens=1)
    local.add_request(b)
    local.enable_kv_events()
    t = local.schedule()
    assert t.storage_fetch_keys == keys, "the peer's write is a hit on this daemon"
    work(local, t, failed_fetches=[b.handle])  # the store evicted them meanwhile
    drain(local, b)
    learn_storage(theirs, decode(publish(local, "m", daemon="b")))
    assert not any(k in theirs for k in keys), "the failed fetch's keys left the peer's index"


def test_events_of_another_model_or_without_a_model_teach_nothing_wrong() -> None:
    theirs, mine = StorageIndex(), StorageIndex()
    peer = sched(theirs)
    peer.enable_kv_events()
    a = make_request(A + [1], max_tokens=1)
    run_to_end(peer, a)
    run_to_end(peer, make_request(FILL, max_tokens=1))
    data = peer.take_kv_events()
    learn_storage(mine, decode(encode_batch("i0", "a", "e", 1, 0.0, BS, {}, data, None)))
    assert len(mine) == 0, "no model published: no keys can be built"
    learn_storage(mine, decode(encode_batch("i0", "a", "e", 1, 0.0, BS, {}, data, {"model": "q"})))
    assert peer.kv.storage is not None
    assert not any(k in mine for k in peer.kv.storage.keys(a.block_hashes[:3]))
    assert len(mine) == 3  # under model q's keys, which model m's instances never ask for
