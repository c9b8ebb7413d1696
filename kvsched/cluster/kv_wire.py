"""The KV-event wire format of the cluster (pure: no I/O; docs/CLUSTER.md): the JSON batches and
snapshots, encoded and decoded; `kv_index.ClusterIndex` applies them.

Every daemon publishes, per instance it owns, batches of KV events on the NATS subject
`kvsched.kv.events.<instance>`, one JSON object per batch:

    {"instance": "i0", "daemon": "a", "epoch": "3f2a...", "seq": 17, "ts": 1733.2,
     "block_size": 16,
     "load": {"running": 3, "waiting": 0, "max_num_seqs": 64, "kv_usage": 0.41,
              "queued_prefill_tokens": 512, "predicted_backlog_ms": 230.5,
              "prefill_token_ms": 0.05, "attention_ms": 2e-7, "swap_block_ms": 0.17,
              "load": 0.4868},
     "events": [{"type": "BlockStored", "block_hashes": ["<hex>", ...],
                 "parent_block_hash": "<hex>" | null, "token_ids": [...], "block_size": 16,
                 "lora_name": null, "medium": "gpu"},
                {"type": "BlockRemoved", "block_hashes": ["<hex>"], "medium": "gpu"},
                {"type": "AllBlocksCleared", "medium": "gpu"}]}

`medium` is the tier (`kvsched.core.kv_events.MEDIA`): "gpu", "cpu" (the instance's host
memory: a block moved there is a cpu BlockStored, a host eviction a cpu BlockRemoved) or
"storage" (the store every instance shares, `kvsched.core.storage`: a write acknowledged is a
storage BlockStored, a failed fetch's keys a storage BlockRemoved). Storage events go into ONE
cluster-wide set of hashes per model (the instance's published model), not into the instance's
own: any instance with a storage tier can fetch them. The load's "load" is the instance's one
load value (`kvsched.core.router.instance_load` of the facts beside it, as its engine computed
it: the number routers read; facts without it are weighed by the same formula at the default
`LOAD_SECONDS`). The load's cost fields are the instance's
step-cost model (ms per prefill token, per unit of the attention term, per block swapped in
from host memory, per block fetched from storage: `fetch_block_ms`, published only by an
instance with a storage tier): peers price its hits with them.

Batches and snapshots may carry the instance's `info` (what its owner's workers announced):
`{"role", "model", "max_model_len", "vocab_size", "multimodal",
"structured_outputs"}` and, for an instance with LoRA
adapters, `"loras": [[name, path], ...]`, `"max_loras"` (0: no limit) and `"active_loras"` (the
adapters of its running or queued requests now: peers route LoRA requests by affinity with it).
A field left out reads as unchecked (multimodal true, no adapters), but `structured_outputs` as false: a
peer that does not say its workers apply constraints gets no constrained request.

`seq` counts the batches of one `epoch` (a publisher's run for one instance) from 1 without
gaps. A consumer that sees an unknown epoch or a seq other than last + 1 asks the owner for a
snapshot (request/reply on `kvsched.kv.snapshot.<instance>`), answered with
`{"instance", "daemon", "epoch", "seq", "block_size", "block_hashes": [...],
"host_block_hashes": [...], "load"}`: the instance's cache (GPU, host memory) after batch `seq`
(optionally "storage_block_hashes": what its owner believes the shared store holds, added to
the storage set). Each list may come packed instead, `"packed_<name>": "<hex>"`: the 16-byte
hashes concatenated in one hex string (what `encode_snapshot` writes: a thousand snapshots of
thousands of hashes decode in one C call each, not one per hash). Batches with seq <= the snapshot's are dropped, later ones
applied. Replaying a batch twice is harmless (events set or clear membership).
"""

from __future__ import annotations

import json
from typing import Any

from kvsched.cluster.hit_index import keys_of_hex, keys_of_packed
from kvsched.core.kv_events import BlockRemoved, BlockStored, KvEvent

EVENTS_SUBJECT = "kvsched.kv.events"  # + ".<instance>"
SNAPSHOT_SUBJECT = "kvsched.kv.snapshot"  # + ".<instance>"


def event_to_json(ev: KvEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [h.hex() for h in ev.block_hashes],
            "parent_block_hash": ev.parent_block_hash.hex() if ev.parent_block_hash else None,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_name": ev.lora_name,
            "medium": ev.medium,
        }
    if isinstance(ev, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h.hex() for h in ev.block_hashes],
            "medium": ev.medium,
        }
    return {"type": "AllBlocksCleared", "medium": ev.medium}


def encode_batch(
    instance: str,
    daemon: str,
    epoch: str,
    seq: int,
    ts: float,
    block_size: int,
    load: dict[str, float],
    events: list[KvEvent],
    info: dict[str, Any] | None = None,
) -> bytes:
    return json.dumps(
        {
            **({"info": info} if info else {}),
            "instance": instance,
            "daemon": daemon,
            "epoch": epoch,
            "seq": seq,
            "ts": ts,
            "block_size": block_size,
            "load": load,
            "events": [event_to_json(e) for e in events],
        },
        separators=(",", ":"),
    ).encode()


def encode_snapshot(
    instance: str,
    daemon: str,
    epoch: str,
    seq: int,
    block_size: int,
    load: dict[str, float],
    hashes: list[bytes],
    info: dict[str, Any] | None = None,
    host_hashes: list[bytes] | None = None,
    storage_hashes: list[bytes] | None = None,
) -> bytes:
    return json.dumps(
        {
            **({"info": info} if info else {}),
            "instance": instance,
            "daemon": daemon,
            "epoch": epoch,
            "seq": seq,
            "block_size": block_size,
            "load": load,
            **_hash_field("block_hashes", hashes),
            **_hash_field("host_block_hashes", host_hashes or []),
            **(_hash_field("storage_block_hashes", storage_hashes) if storage_hashes else {}),
        },
        separators=(",", ":"),
    ).encode()


def _hash_field(name: str, hashes: list[bytes]) -> dict[str, Any]:
    """A snapshot's hash list: packed into one hex string when every hash is 16 bytes
    (kvsched's: decoding is one C call instead of one per hash), else a list of hex."""
    raw = b"".join(hashes)
    if len(raw) == 16 * len(hashes):
        return {"packed_" + name: raw.hex()}
    return {name: [h.hex() for h in hashes]}


def snapshot_keys(snap: dict[str, Any], name: str) -> list[int]:
    """The keys of a snapshot's hash list `name`: packed (`packed_<name>`, one hex string of
    16-byte hashes) or a list of hex strings."""
    packed = snap.get("packed_" + name)
    if packed:
        return keys_of_packed(str(packed))
    return keys_of_hex(snap.get(name) or [])


def decode(data: bytes) -> dict[str, Any]:
    out = json.loads(data)
    if not isinstance(out, dict) or "instance" not in out:
        raise ValueError("not a kvsched KV-event batch or snapshot")
    return out
