"""The cluster prefix index (pure): batches in order, gaps, snapshots, new epochs."""

from __future__ import annotations

import json

from kvsched.cluster.hit_index import keys_of
from kvsched.cluster.kv_index import ClusterIndex, decode, encode_batch, encode_snapshot
from kvsched.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvsched.core.router import LOAD_SECONDS, instance_load

H = [bytes([i]) * 16 for i in range(8)]


def keys(hs: list[bytes]) -> set[int]:
    """The index's keys of these hashes."""
    return set(keys_of(hs))


def batch(seq: int, events: list, epoch: str = "e1") -> dict:  # type: ignore[type-arg]
    return decode(encode_batch("i0", "d", epoch, seq, 0.0, 16, {"running": 1.0}, events))


def test_wire_format_names_follow_vllm() -> None:
    raw = encode_batch(
        "i0", "d", "e1", 1, 0.0, 16, {},
        [BlockStored([H[0], H[1]], None, list(range(32)), 16), BlockRemoved([H[0]]),
         AllBlocksCleared()],
    )  # fmt: skip
    evs = json.loads(raw)["events"]
    assert evs[0]["type"] == "BlockStored" and evs[0]["block_hashes"] == [H[0].hex(), H[1].hex()]
    assert evs[0]["parent_block_hash"] is None and evs[0]["medium"] == "gpu"
    assert evs[0]["token_ids"] == list(range(32)) and evs[0]["block_size"] == 16
    assert evs[1] == {"type": "BlockRemoved", "block_hashes": [H[0].hex()], "medium": "gpu"}
    assert evs[2] == {"type": "AllBlocksCleared", "medium": "gpu"}


def test_in_order_batches_apply_and_a_gap_waits_for_a_snapshot() -> None:
    idx = ClusterIndex()
    assert not idx.apply_batch(batch(1, [AllBlocksCleared(), BlockStored(H[:3], None, [], 16)]))
    # Unknown instance: a snapshot is needed first; the batch is kept and replayed after it.
    idx.apply_snapshot(json.loads(encode_snapshot("i0", "d", "e1", 0, 16, {}, [])))
    assert idx.instances["i0"].hashes == keys(H[:3])
    assert idx.apply_batch(batch(2, [BlockRemoved([H[0]])]))
    assert idx.instances["i0"].hashes == keys(H[1:3])
    assert not idx.apply_batch(batch(4, [BlockStored([H[5]], None, [], 16)]))  # 3 was lost
    assert idx.num_gaps == 1
    assert not idx.apply_batch(batch(5, [BlockStored([H[6]], None, [], 16)]))  # waits too
    # The owner's snapshot after batch 4 (it holds 1, 2, 4's and 3's blocks): 5 is replayed.
    snap = encode_snapshot("i0", "d", "e1", 4, 16, {}, [H[1], H[2], H[4], H[5]])
    idx.apply_snapshot(json.loads(snap))
    assert idx.instances["i0"].hashes == keys([H[1], H[2], H[4], H[5], H[6]])
    assert idx.instances["i0"].seq == 5
    assert idx.apply_batch(batch(5, [BlockRemoved([H[6]])]))  # a duplicate: ignored
    assert keys([H[6]]) <= idx.instances["i0"].hashes


def test_a_new_epoch_starts_empty_without_a_snapshot() -> None:
    idx = ClusterIndex()
    idx.apply_snapshot(json.loads(encode_snapshot("i0", "d", "e1", 7, 16, {}, H[:4])))
    assert idx.apply_batch(batch(1, [AllBlocksCleared(), BlockStored([H[7]], None, [], 16)], "e2"))
    assert idx.instances["i0"].hashes == keys([H[7]]) and idx.num_gaps == 0
    assert idx.instances["i0"].prefix_blocks([H[7], H[1]]) == 1


def test_the_load_column_is_the_load_value_the_owner_published() -> None:
    """Routing weighs a peer's instance by the load value its engine published (`load`); facts
    that carry none (an older peer) are weighed by the one formula at the default weight."""
    facts = {"running": 2.0, "waiting": 1.0, "max_num_seqs": 8.0, "kv_usage": 0.25}
    facts["predicted_backlog_ms"] = 600.0
    idx = ClusterIndex()
    snap = encode_snapshot("i0", "d", "e1", 0, 16, {**facts, "load": 0.7}, [], None, [])
    idx.apply_snapshot(decode(snap))
    slot = idx.instances["i0"].slot
    assert idx.table.load[slot] == 0.7  # not the 0.45 its facts would give here
    assert idx.apply_batch(decode(encode_batch("i0", "d", "e1", 1, 0.0, 16, facts, [])))
    assert idx.table.load[slot] == instance_load(facts, LOAD_SECONDS) == 600 / 3000 + 0.25


def test_published_adapters_give_a_peers_lora_affinity() -> None:
    """A peer's info names its adapters, max_loras and the adapters in use: its LoRA affinity
    is the core's rule over them (2 in use, 1 a free slot, 0 neither), with the adapters this
    daemon forwarded to it since counted until its next published load; an info without
    these fields (an older peer) reads as no adapters, multimodal unchecked."""
    info = {"model": "m", "loras": [["x", "/a/x"], ["y", "/a/y"]], "max_loras": 1}
    idx = ClusterIndex()
    idx.apply_snapshot(decode(encode_snapshot("i0", "d", "e1", 0, 16, {"running": 0.0}, [], info)))
    v = idx.instances["i0"]
    assert v.loras == (("x", "/a/x"), ("y", "/a/y")) and v.max_loras == 1 and v.multimodal
    assert (v.lora_affinity("x"), v.lora_affinity("y")) == (1, 1)  # a free slot for either
    v.loras_sent.add("x")  # forwarded there: held until its next load
    assert (v.lora_affinity("x"), v.lora_affinity("y")) == (2, 0)
    busy = {**info, "active_loras": ["y"], "multimodal": False}
    assert idx.apply_batch(
        decode(encode_batch("i0", "d", "e1", 1, 0.0, 16, {"running": 1.0}, [], busy))
    )
    assert not v.loras_sent and not v.multimodal
    assert (v.lora_affinity("x"), v.lora_affinity("y")) == (0, 2)
    assert idx.apply_batch(
        decode(encode_batch("i0", "d", "e1", 2, 0.0, 16, {}, [], {"model": "m"}))
    )
    assert v.loras == () and v.multimodal
