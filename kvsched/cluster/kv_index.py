"""The cluster prefix index (pure: no I/O; docs/CLUSTER.md): `ClusterIndex` applies the KV-event
batches and snapshots peers publish (their wire format, `kv_wire`, re-exported here) to one
view per instance (`InstanceView`: GPU and host-memory hashes, load, info) and the cluster-wide
storage sets, and keeps the load table routers read (`LoadTable`).

`seq` counts the batches of one `epoch` (a publisher's run for one instance) from 1 without
gaps. A consumer that sees an unknown epoch or a seq other than last + 1 asks the owner for a
snapshot; batches with seq <= the snapshot's are dropped, later ones applied (at most
`MAX_PENDING` kept while it is awaited). Replaying a batch twice is harmless (events set or
clear membership).
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.cluster.hit_index import HitIndex, KeySet, discard_keys, keys_of, keys_of_hex
from kvsched.cluster.kv_wire import (
    EVENTS_SUBJECT,
    SNAPSHOT_SUBJECT,
    decode,
    encode_batch,
    encode_snapshot,
    event_to_json,
    snapshot_keys,
)
from kvsched.core.kv_events import CPU, GPU, STORAGE
from kvsched.core.router import LOAD_SECONDS, instance_load

__all__ = [
    "EVENTS_SUBJECT",
    "MAX_PENDING",
    "SNAPSHOT_SUBJECT",
    "ClusterIndex",
    "InstanceView",
    "LoadTable",
    "decode",
    "encode_batch",
    "encode_snapshot",
    "event_to_json",
]

MAX_PENDING = 512  # batches kept per instance while a snapshot is awaited (older: dropped)


@dataclass
class InstanceView:
    """What one daemon knows of one instance from its events."""

    instance_id: str
    daemon: str = ""
    epoch: str = ""
    seq: int = 0
    block_size: int = 0
    # Hash keys (`hit_index.key64`) in its GPU pool and in its host-memory tier, as dicts'
    # keys (`hit_index.KeySet`: containers the garbage collector does not traverse).
    gpu_keys: KeySet = field(default_factory=dict, repr=False)
    host_keys: KeySet = field(default_factory=dict, repr=False)
    slot: int = -1  # its index in the ClusterIndex's HitIndex and arrays
    load: dict[str, float] = field(default_factory=dict)
    synced: bool = False  # a snapshot (or an epoch's first batch) was applied: hashes are whole
    pending: list[dict[str, Any]] = field(default_factory=list)  # batches while resyncing
    sent_since_load: int = 0  # requests this daemon forwarded since the last load heard
    heard: float = 0.0  # when its last batch or snapshot was applied (the caller's clock)
    # Its model and limits ("info": server/instances/models.py; "" / 0 from a daemon that sends none).
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    role: str = "mixed"  # core.config.Role's value: a decode instance takes no new request
    multimodal: bool = True  # runs requests' multimodal items (unchecked when not published)
    structured_outputs: bool = False  # applies structured-output constraints (False: not said)
    # Its LoRA adapters (name, path) as its workers announced them, its max_loras (0: no
    # limit), the adapters running or queued there at its last publication, and the adapters
    # of the requests this daemon forwarded to it since (`ClusterRouter.commit`).
    loras: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0
    active_loras: frozenset[str] = frozenset()
    loras_sent: set[str] = field(default_factory=set)

    @property
    def hashes(self) -> KeysView[int]:
        """Its GPU pool's hash keys (a set-like view)."""
        return self.gpu_keys.keys()

    @property
    def host(self) -> KeysView[int]:
        """Its host-memory tier's hash keys (a set-like view)."""
        return self.host_keys.keys()

    def take_info(self, info: dict[str, Any] | None) -> None:
        self.set_info(read_info(info))

    def set_info(self, got: PeerInfo | None) -> None:
        if got is not None:
            self.role, self.model = got.role, got.model
            self.max_model_len, self.vocab_size = got.max_model_len, got.vocab_size
            self.multimodal, self.loras = got.multimodal, got.loras
            self.structured_outputs = got.structured_outputs
            self.max_loras, self.active_loras = got.max_loras, got.active_loras

    def lora_affinity(self, name: str) -> int:
        """`core.scheduler.facts.Facts.lora_affinity`'s rule over what the instance published
        (and the requests of adapters forwarded to it since): 2 the adapter runs or waits
        there, 1 a free adapter slot, 0 neither."""
        active = self.active_loras | self.loras_sent
        if name in active:
            return 2
        return 1 if not self.max_loras or len(active) < self.max_loras else 0

    def prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a request (its chained hashes) this instance holds."""
        n, hs = 0, self.gpu_keys
        for h in keys_of(block_hashes):
            if h not in hs:
                break
            n += 1
        return n

    def tier_blocks(self, block_hashes: list[bytes]) -> tuple[int, int]:
        """(GPU blocks, GPU + host blocks) of the request's longest cached run here: the GPU
        prefix, then its continuation in host memory (Scheduler.prefix_hit_tokens' rule)."""
        g = self.prefix_blocks(block_hashes)
        n, hs = g, self.host_keys
        for h in keys_of(block_hashes[g:]):
            if h not in hs:
                break
            n += 1
        return g, n

    def medium(self, name: str) -> KeySet | None:
        """Its own hash keys of a private tier (None for storage: shared, `HitIndex.storage`)."""
        return self.gpu_keys if name == GPU else self.host_keys if name == CPU else None


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """An instance's published info as read (kv_wire's "info")."""

    role: str
    model: str
    max_model_len: int
    vocab_size: int
    multimodal: bool
    loras: tuple[tuple[str, str], ...]  # its LoRA adapters, (name, path)
    max_loras: int
    active_loras: frozenset[str]  # the adapters of its running or queued requests
    structured_outputs: bool = False  # its workers apply structured-output constraints


def read_info(info: dict[str, Any] | None) -> PeerInfo | None:
    """A published info's fields; None when there is none. A field a daemon does not send
    reads as unchecked: multimodal True, no adapters; structured outputs False (a peer that
    does not say its workers apply constraints gets no such request)."""
    if not info:
        return None
    return PeerInfo(
        str(info.get("role", "mixed")),
        str(info.get("model", "")),
        int(info.get("max_model_len", 0)),
        int(info.get("vocab_size", 0)),
        bool(info.get("multimodal", True)),
        tuple((str(n), str(p)) for n, p in info.get("loras") or ()),
        int(info.get("max_loras", 0)),
        frozenset(str(n) for n in info.get("active_loras") or ()),
        bool(info.get("structured_outputs", False)),
    )


class LoadTable:
    """Per slot, what routing reads of an instance, kept as numpy columns so that a decision
    over a thousand instances is a few vector operations (set from each published load)."""

    COLUMNS = (
        "heard",
        "block_size",
        "load",
        "backlog_ms",
        "kv_usage",
        "max_num_seqs",
        "sent",
        "prefill_token_ms",
        "attention_ms",
        "swap_block_ms",
        "fetch_block_ms",
    )

    def __init__(self) -> None:
        self.size = 0
        for c in self.COLUMNS:
            setattr(self, c, np.zeros(0))
        self.heard: npt.NDArray[np.float64]
        self.block_size: npt.NDArray[np.float64]
        self.load: npt.NDArray[np.float64]  # the load value it published (`instance_load`)
        self.backlog_ms: npt.NDArray[np.float64]
        self.kv_usage: npt.NDArray[np.float64]
        self.max_num_seqs: npt.NDArray[np.float64]
        self.sent: npt.NDArray[np.float64]  # requests forwarded since its last load was heard
        self.prefill_token_ms: npt.NDArray[np.float64]
        self.attention_ms: npt.NDArray[np.float64]
        self.swap_block_ms: npt.NDArray[np.float64]
        self.fetch_block_ms: npt.NDArray[np.float64]  # < 0: the instance has no storage tier

    def grow(self, n: int) -> None:
        if n <= self.size:
            return
        cap = max(n, 2 * self.size, 16)
        for c in self.COLUMNS:
            col = np.zeros(cap)
            col[: self.size] = getattr(self, c)[: self.size]
            setattr(self, c, col)
        self.size = cap

    def reset(self, slot: int) -> None:
        for c in self.COLUMNS:
            getattr(self, c)[slot] = 0.0

    def set(self, v: InstanceView) -> None:
        i, ld = v.slot, v.load
        self.block_size[i] = v.block_size or 16
        # A peer publishing counts only (no cost model): its queued requests at ~1 s each.
        waiting = ld.get("waiting", 0.0)
        self.backlog_ms[i] = ld.get("predicted_backlog_ms", 1e3 * waiting)
        # Its owner's one load value; facts without one (an older peer): the same formula.
        self.load[i] = ld["load"] if "load" in ld else instance_load(ld, LOAD_SECONDS)
        self.kv_usage[i] = ld.get("kv_usage", 0.0)
        self.max_num_seqs[i] = max(1.0, ld.get("max_num_seqs", 1.0))
        self.sent[i] = 0.0
        self.prefill_token_ms[i] = ld.get("prefill_token_ms", 0.0)
        self.attention_ms[i] = ld.get("attention_ms", 0.0)
        self.swap_block_ms[i] = ld.get("swap_block_ms", 0.0)
        self.fetch_block_ms[i] = ld.get("fetch_block_ms", -1.0)


class ClusterIndex:
    """Per instance: its cached block hashes and load, kept from event batches and snapshots.

    `apply_batch` returns True when the batch was applied, False when it revealed a gap (or an
    unknown epoch): the caller then fetches a snapshot and hands it to `apply_snapshot`; the
    batches received meanwhile are kept and replayed after it."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceView] = {}
        self.num_gaps = 0
        self.num_snapshots = 0
        self.hits = HitIndex()
        self.slots: list[InstanceView | None] = []  # slot -> view (None: free)
        self._free_slots: list[int] = []
        self.version = 0  # bumped when an instance is added, forgotten or (re)synced
        self.table = LoadTable()  # per slot: the numbers routing reads, as arrays

    def view(self, instance_id: str) -> InstanceView:
        v = self.instances.get(instance_id)
        if v is None:
            v = self.instances[instance_id] = InstanceView(instance_id)
            if self._free_slots:
                v.slot = self._free_slots.pop()
                self.slots[v.slot] = v
            else:
                v.slot = len(self.slots)
                self.slots.append(v)
                self.table.grow(len(self.slots))
            self.table.reset(v.slot)
            self.table.fetch_block_ms[v.slot] = -1.0
            self.version += 1
        return v

    def _clear(self, v: InstanceView, medium: str | None = None) -> None:
        """Drop an instance's hashes of one medium (None: every medium)."""
        for m in (GPU, CPU) if medium is None else (medium,):
            hs = v.medium(m)
            if hs:
                self.hits.remove(m, v.slot, list(hs))
                hs.clear()

    def apply_batch(self, batch: dict[str, Any], now: float = 0.0) -> bool:
        v = self.view(str(batch["instance"]))
        v.heard = max(v.heard, now)
        self.table.heard[v.slot] = v.heard
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
                self._clear(v)
                self.version += 1
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
            v.loras_sent.clear()  # (the info beside it names the adapters it holds now)
            self.table.set(v)
        slot, hits = v.slot, self.hits
        for ev in batch.get("events", ()):
            kind, medium = ev.get("type"), ev.get("medium", GPU)
            hs = v.medium(medium)
            if hs is None:
                if medium == STORAGE and kind in ("BlockStored", "BlockRemoved"):
                    got = keys_of_hex(ev["block_hashes"])
                    if kind == "BlockStored":
                        hits.add(STORAGE, slot, got, v.model)
                    else:
                        hits.remove(STORAGE, slot, got, v.model)
                continue  # an unknown medium; storage is never cleared by one instance
            if kind == "BlockStored":
                got = keys_of_hex(ev["block_hashes"])
                hs.update(dict.fromkeys(got))
                hits.add(medium, slot, got)
            elif kind == "BlockRemoved":
                got = keys_of_hex(ev["block_hashes"])
                discard_keys(hs, got)
                hits.remove(medium, slot, got)
            elif kind == "AllBlocksCleared":
                self._clear(v, medium)

    def apply_snapshot(self, snap: dict[str, Any], now: float = 0.0) -> None:
        self.apply_snapshots([snap], now)

    def apply_snapshots(self, snaps: Sequence[dict[str, Any]], now: float = 0.0) -> None:
        """`apply_snapshot` of each, in order (the same index as one by one), with the holders
        of many snapshots' hashes added at once (`HitIndex.add_many`: a restarted daemon
        hearing from many instances). Every snapshot is read first: a malformed one raises
        (ValueError, KeyError, TypeError) before anything changes."""
        read = [_read_snapshot(snap) for snap in snaps]
        i = 0
        while i < len(read):  # groups of distinct instances (a second snapshot: a new group)
            seen: set[str] = set()
            j = i
            while j < len(read) and read[j].instance not in seen:
                seen.add(read[j].instance)
                j += 1
            self._apply_snapshots(read[i:j], now)
            i = j

    def _apply_snapshots(self, group: Sequence[_Snapshot], now: float) -> None:
        """Snapshots of distinct instances: every view's sets, then the holders at once, then
        per snapshot its storage keys, load and the batches that waited for it."""
        parts: list[tuple[str, int, list[int]]] = []
        views: list[InstanceView] = []
        for snap in group:
            v = self.view(snap.instance)
            v.heard = max(v.heard, now)
            self.table.heard[v.slot] = v.heard
            self.num_snapshots += 1
            v.daemon, v.epoch, v.seq = snap.daemon, snap.epoch, snap.seq
            v.block_size = snap.block_size
            v.set_info(snap.info)
            self._clear(v)
            v.gpu_keys.update(dict.fromkeys(snap.gpu))
            v.host_keys.update(dict.fromkeys(snap.host))
            parts += [(GPU, v.slot, snap.gpu), (CPU, v.slot, snap.host)]
            views.append(v)
        self.hits.add_many(parts)
        for snap, v in zip(group, views, strict=True):
            if snap.stored:  # what the owner believes the shared store holds (never cleared)
                self.hits.add(STORAGE, v.slot, snap.stored, v.model)
            if snap.load:
                v.load = snap.load
                v.loras_sent.clear()
            self.table.set(v)
            v.synced = True
            self.version += 1
            pending, v.pending = v.pending, []
            for batch in sorted(pending, key=lambda b: int(b["seq"])):
                if str(batch["epoch"]) == v.epoch and int(batch["seq"]) > v.seq:
                    self.apply_batch(batch)

    def forget(self, instance_id: str) -> None:
        v = self.instances.pop(instance_id, None)
        if v is not None:
            self._clear(v)
            self.slots[v.slot] = None
            self._free_slots.append(v.slot)
            self.version += 1

    def digest(self) -> dict[str, frozenset[int]]:
        """Every instance's GPU hash keys (for comparing two daemons' indexes)."""
        return {i: frozenset(v.hashes) for i, v in self.instances.items() if v.synced}

    def host_digest(self) -> dict[str, frozenset[int]]:
        """Every instance's host-memory hash keys."""
        return {i: frozenset(v.host) for i, v in self.instances.items() if v.synced}


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A snapshot as read (`_read_snapshot`), before it changes the index."""

    instance: str
    daemon: str
    epoch: str
    seq: int
    block_size: int
    info: PeerInfo | None
    gpu: list[int]
    host: list[int]
    stored: list[int]
    load: dict[str, float]


def _read_snapshot(snap: dict[str, Any]) -> _Snapshot:
    return _Snapshot(
        str(snap["instance"]),
        str(snap["daemon"]),
        str(snap["epoch"]),
        int(snap["seq"]),
        int(snap["block_size"]),
        read_info(snap.get("info")),
        snapshot_keys(snap, "block_hashes"),
        snapshot_keys(snap, "host_block_hashes"),
        snapshot_keys(snap, "storage_block_hashes"),
        dict(snap.get("load") or {}),
    )
