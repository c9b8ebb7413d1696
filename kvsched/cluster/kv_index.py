"""The cluster prefix index and the KV-event wire format (pure: no I/O; docs/CLUSTER.md).

Every daemon publishes, per instance it owns, batches of KV events on the NATS subject
`kvsched.kv.events.<instance>`, one JSON object per batch:

    {"instance": "i0", "daemon": "a", "epoch": "3f2a...", "seq": 17, "ts": 1733.2,
     "block_size": 16,
     "load": {"running": 3, "waiting": 0, "max_num_seqs": 64, "kv_usage": 0.41,
              "queued_prefill_tokens": 512, "predicted_backlog_ms": 230.5},
     "events": [{"type": "BlockStored", "block_hashes": ["<hex>", ...],
                 "parent_block_hash": "<hex>" | null, "token_ids": [...], "block_size": 16,
                 "lora_name": null, "medium": "gpu"},
                {"type": "BlockRemoved", "block_hashes": ["<hex>"], "medium": "gpu"},
                {"type": "AllBlocksCleared", "medium": "gpu"}]}

`seq` counts the batches of one `epoch` (a publisher's run for one instance) from 1 without
gaps. A consumer that sees an unknown epoch or a seq other than last + 1 asks the owner for a
snapshot (request/reply on `kvsched.kv.snapshot.<instance>`), answered with
`{"instance", "daemon", "epoch", "seq", "block_size", "block_hashes": [...], "load"}`: the
instance's cache after batch `seq`. Batches with seq <= the snapshot's are dropped, later ones
applied. Replaying a batch twice is harmless (events set or clear membership).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvsched.core.kv_events import BlockRemoved, BlockStored, KvEvent

EVENTS_SUBJECT = "kvsched.kv.events"  # + ".<instance>"
MAX_PENDING = 512  # batches kept per instance while a snapshot is awaited (older: dropped)
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
            "block_hashes": [h.hex() for h in hashes],
        },
        separators=(",", ":"),
    ).encode()


@dataclass
class InstanceView:
    """What one daemon knows of one instance from its events."""

    instance_id: str
    daemon: str = ""
    epoch: str = ""
    seq: int = 0
    block_size: int = 0
    hashes: set[bytes] = field(default_factory=set)
    load: dict[str, float] = field(default_factory=dict)
    synced: bool = False  # a snapshot (or an epoch's first batch) was applied: hashes are whole
    pending: list[dict[str, Any]] = field(default_factory=list)  # batches while resyncing
    sent_since_load: int = 0  # requests this daemon forwarded since the last load heard
    heard: float = 0.0  # when its last batch or snapshot was applied (the caller's clock)
    # Its model and limits ("info": server/models.py; "" / 0 from a daemon that sends none).
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0

    def take_info(self, info: dict[str, Any] | None) -> None:
        if info:
            self.model = str(info.get("model", ""))
            self.max_model_len = int(info.get("max_model_len", 0))
            self.vocab_size = int(info.get("vocab_size", 0))

    def prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a request (its chained hashes) this instance holds."""
        n, hs = 0, self.hashes
        for h in block_hashes:
            if h not in hs:
                break
            n += 1
        return n


class ClusterIndex:
    """Per instance: its cached block hashes and load, kept from event batches and snapshots.

    `apply_batch` returns True when the batch was applied, False when it revealed a gap (or an
    unknown epoch): the caller then fetches a snapshot and hands it to `apply_snapshot`; the
    batches received meanwhile are kept and replayed after it."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceView] = {}
        self.num_gaps = 0
        self.num_snapshots = 0

    def view(self, instance_id: str) -> InstanceView:
        v = self.instances.get(instance_id)
        if v is None:
            v = self.instances[instance_id] = InstanceView(instance_id)
        return v

    def apply_batch(self, batch: dict[str, Any], now: float = 0.0) -> bool:
        v = self.view(str(batch["instance"]))
        v.heard = max(v.heard, now)
        epoch, seq = str(batch["epoch"]), int(batch["seq"])
        if not v.synced:
            v.pending.append(batch)
            del v.pending[:-MAX_PENDING]  # the snapshot covers what is dropped
            return False
        if epoch == v.epoch and seq <= v.seq:
            return True  # already in (a snapshot covered it, or a duplicate)
        if epoch != v.epoch or seq != v.seq + 1:
            if epoch != v.epoch and seq == 1:
                # A new publisher's first batch starts from an empty cache (AllBlocksCleared
                # comes first): nothing is missing.
                v.hashes.clear()
            else:
                self.num_gaps += 1
                v.synced = False
                v.pending.append(batch)
                return False
        self._apply(v, batch)
        return True

    def _apply(self, v: InstanceView, batch: dict[str, Any]) -> None:
        v.daemon, v.epoch, v.seq = str(batch["daemon"]), str(batch["epoch"]), int(batch["seq"])
        v.block_size = int(batch.get("block_size", v.block_size))
        v.take_info(batch.get("info"))
        load = batch.get("load")
        if load:
            v.load = dict(load)
            v.sent_since_load = 0
        hs = v.hashes
        for ev in batch.get("events", ()):
            kind = ev.get("type")
            if kind == "BlockStored":
                hs.update(bytes.fromhex(h) for h in ev["block_hashes"])
            elif kind == "BlockRemoved":
                hs.difference_update(bytes.fromhex(h) for h in ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                hs.clear()

    def apply_snapshot(self, snap: dict[str, Any], now: float = 0.0) -> None:
        v = self.view(str(snap["instance"]))
        v.heard = max(v.heard, now)
        self.num_snapshots += 1
        v.daemon, v.epoch, v.seq = str(snap["daemon"]), str(snap["epoch"]), int(snap["seq"])
        v.block_size = int(snap["block_size"])
        v.take_info(snap.get("info"))
        v.hashes = {bytes.fromhex(h) for h in snap["block_hashes"]}
        if snap.get("load"):
            v.load = dict(snap["load"])
        v.synced = True
        pending, v.pending = v.pending, []
        for batch in sorted(pending, key=lambda b: int(b["seq"])):
            if str(batch["epoch"]) == v.epoch and int(batch["seq"]) > v.seq:
                self.apply_batch(batch)

    def forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def digest(self) -> dict[str, frozenset[bytes]]:
        """Every instance's hashes (for comparing two daemons' indexes)."""
        return {i: frozenset(v.hashes) for i, v in self.instances.items() if v.synced}


def decode(data: bytes) -> dict[str, Any]:
    out = json.loads(data)
    if not isinstance(out, dict) or "instance" not in out:
        raise ValueError("not a kvsched KV-event batch or snapshot")
    return out
