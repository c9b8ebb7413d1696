"""KV events and load over NATS: publish this daemon's instances, index everyone's.

    this daemon's engines --take_kv_events (every flush_s)--> KvStream.flush --> NATS subject
    kvsched.kv.events.<instance>  --every daemon's subscription--> ClusterIndex.apply_batch
                                                        gap / unknown epoch --> snapshot request
    kvsched.kv.snapshot.<instance> <-- the owner answers from its engine (after a flush)

The wire format is in `kv_index.py` and docs/CLUSTER.md. Peers' storage events (medium
"storage": a write acknowledged, a key gone) also go into this daemon's shared storage index
(`storage_index`, core/storage.py), so its instances hit keys other daemons wrote. A batch is published for an instance
when it has events, or at least every `load_every_s` with its load alone. Publishing while NATS
is down fails silently (the batch is dropped and its seq not used, so the next batch is a gap
for nobody; subscribers that missed batches during the outage find the gap by seq anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kvsched.cluster.kv_index import (
    EVENTS_SUBJECT,
    SNAPSHOT_SUBJECT,
    ClusterIndex,
    decode,
    encode_batch,
    encode_snapshot,
)
from kvsched.cluster.link import ClusterLink
from kvsched.core.kv_events import STORAGE
from kvsched.core.storage import StorageIndex

log = logging.getLogger("kvsched.cluster")

# A snapshot carries at most this many stored keys of the shared storage tier (the newest): 16
# bytes each, packed as hex, 8,192 keys are 256 KiB, well within NATS's 1 MiB message limit
# beside the GPU and host lists.
SNAPSHOT_STORAGE_KEYS = 8192


class KvSource(Protocol):
    """An instance whose KV events and load a daemon publishes: its engine (the engine's facts;
    a Scheduler has the same members, for tests without a daemon)."""

    @property
    def epoch(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def enable_kv_events(self) -> None: ...

    def take_kv_events(self) -> list[Any]: ...

    def cached_block_hashes(self) -> list[bytes]: ...

    def published_load(self) -> dict[str, float]: ...

    def host_block_hashes(self) -> list[bytes]: ...


class _Pub:
    """One instance's publishing state: the source epoch it follows, its stream epoch, seq."""

    __slots__ = ("epoch", "last_sent", "seq", "source_epoch")

    def __init__(self, source_epoch: int) -> None:
        self.source_epoch = source_epoch
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.last_sent = 0.0


class KvStream:
    def __init__(
        self,
        link: ClusterLink,
        sources: Callable[[], Mapping[str, KvSource]],
        flush_s: float = 0.02,
        load_every_s: float = 0.25,
    ) -> None:
        self.link = link
        self.daemon_id = link.daemon_id
        self._sources = sources  # this daemon's ready instances
        self.flush_s = flush_s
        self.load_every_s = load_every_s
        self.index = ClusterIndex()
        self._pubs: dict[str, _Pub] = {}
        self._subs: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._syncing: set[str] = set()
        # Snapshots received and not yet applied, each with its fetch's future (`_apply_snapshot`).
        self._snaps: list[tuple[dict[str, Any], asyncio.Future[None]]] = []
        self.num_published = 0
        self.drop_next = False  # tests: drop the next batch instead of publishing it
        # An instance's model and limits, published with its load (None: not published).
        self.info_of: Callable[[str], dict[str, Any] | None] | None = None
        # This daemon's storage index (None: no storage tier): peers' storage events feed it.
        self.storage_index: StorageIndex | None = None

    def _info(self, iid: str) -> dict[str, Any] | None:
        return None if self.info_of is None else self.info_of(iid)

    async def start(self, publish_every_flush_s: bool = True) -> None:
        """Subscribe to everyone's batches and answer snapshot requests for this daemon's
        instances; publish every `flush_s` (False: only when `flush()` is called)."""
        nc = self.link.nc
        self._subs = [
            await nc.subscribe(f"{EVENTS_SUBJECT}.>", cb=self._on_batch),
            await nc.subscribe(f"{SNAPSHOT_SUBJECT}.>", cb=self._on_snapshot_request),
        ]
        await nc.flush()  # the server has the subscriptions before anything is published
        if publish_every_flush_s:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="kv-stream")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def sync(self, instance_id: str) -> None:
        """Fetch a snapshot of `instance_id` (a late join, or a gap)."""
        if instance_id not in self._syncing:
            self._syncing.add(instance_id)
            asyncio.get_running_loop().create_task(self._fetch(instance_id))

    # ---- publishing -------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                await self.flush()
            except Exception as exc:  # never let one bad publish stop the stream
                log.debug("kv stream flush: %r", exc)

    async def flush(self, only: str | None = None) -> None:
        now = time.monotonic()
        sources = self._sources()
        for iid in [i for i in self._pubs if i not in sources]:
            del self._pubs[iid]
        for iid, src in sources.items():
            if only is not None and iid != only:
                continue
            pub = self._pubs.get(iid)
            if pub is None or pub.source_epoch != src.epoch:  # a new scheduler: a new stream
                pub = self._pubs[iid] = _Pub(src.epoch)
                src.enable_kv_events()
            events = src.take_kv_events()
            # Load rides with every event batch, alone at least every load_every_s: it is not
            # computed (a scan of the queue and the cost model) on the flushes that send nothing.
            if not events and now - pub.last_sent < self.load_every_s:
                continue
            load = src.published_load()
            pub.seq += 1
            data = encode_batch(
                iid,
                self.daemon_id,
                pub.epoch,
                pub.seq,
                time.time(),
                src.block_size,
                load,
                events,
                self._info(iid),
            )
            pub.last_sent = now
            if self.drop_next:
                self.drop_next = False
                continue  # a lost batch: subscribers must find the gap
            try:
                await self.link.nc.publish(f"{EVENTS_SUBJECT}.{iid}", data)
                self.num_published += 1
            except Exception as exc:
                log.debug("kv stream: publish for %s failed: %r", iid, exc)

    async def _on_snapshot_request(self, msg: Any) -> None:
        iid = msg.subject[len(SNAPSHOT_SUBJECT) + 1 :]
        src = self._sources().get(iid)
        if src is None or not msg.reply:
            return  # not ours: the owner answers
        await self.flush(only=iid)  # what is recorded goes out first: the snapshot follows it
        pub = self._pubs[iid]
        data = encode_snapshot(
            iid,
            self.daemon_id,
            pub.epoch,
            pub.seq,
            src.block_size,
            src.published_load(),
            src.cached_block_hashes(),
            self._info(iid),
            src.host_block_hashes(),
            self._stored_hashes(iid, src.block_size),
        )
        with contextlib.suppress(Exception):
            await msg.respond(data)

    def _stored_hashes(self, iid: str, block_size: int) -> list[bytes]:
        """What this daemon believes the shared store holds in `iid`'s namespace (its newest
        `SNAPSHOT_STORAGE_KEYS`), for a snapshot: a restarted peer learns the store's
        contents from it, not only from storage events written after its restart."""
        info = self._info(iid) or {}
        model = info.get("model")
        if self.storage_index is None or not model:
            return []
        prefix = f"{model}/{block_size}/"
        keys = self.storage_index.recent(prefix, SNAPSHOT_STORAGE_KEYS)
        out = []
        for k in keys:
            try:
                out.append(bytes.fromhex(k[len(prefix) :]))
            except ValueError:
                continue
        return out

    # ---- the index --------------------------------------------------------------------------
    async def _on_batch(self, msg: Any) -> None:
        try:
            batch = decode(msg.data)
        except ValueError as exc:
            log.warning("kv stream: unreadable batch on %s: %s", msg.subject, exc)
            return
        if self.storage_index is not None and batch.get("daemon") != self.daemon_id:
            learn_storage(self.storage_index, batch)
        if not self.index.apply_batch(batch, time.monotonic()):
            self.sync(str(batch["instance"]))

    async def _apply_snapshot(self, snap: dict[str, Any]) -> None:
        """Apply `snap` with every other snapshot that arrives in the same turn of the event
        loop (a restarted daemon hears from many instances at once): one
        `ClusterIndex.apply_snapshots` for all of them. Raises what applying `snap` raises."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._snaps:
            loop.call_soon(self._apply_snapshots)
        self._snaps.append((snap, done))
        await done

    def _apply_snapshots(self) -> None:
        got, self._snaps = self._snaps, []
        now = time.monotonic()
        try:
            self.index.apply_snapshots([snap for snap, _ in got], now)
            errors: list[BaseException | None] = [None] * len(got)
        except Exception:
            # A malformed one (raised before anything changed: every snapshot is read first):
            # each alone, so that only its own fetch sees the error and asks again.
            errors = []
            for snap, _ in got:
                try:
                    self.index.apply_snapshot(snap, now)
                    errors.append(None)
                except Exception as exc:
                    errors.append(exc)
        for (_, done), error in zip(got, errors, strict=True):
            if done.done():  # its fetch was cancelled
                continue
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    async def _fetch(self, iid: str) -> None:
        try:
            for _ in range(20):
                try:
                    reply = await self.link.nc.request(
                        f"{SNAPSHOT_SUBJECT}.{iid}", b"", timeout=1.0
                    )
                    snap = decode(reply.data)
                    await self._apply_snapshot(snap)
                    if self.storage_index is not None and snap.get("daemon") != self.daemon_id:
                        learn_stored(self.storage_index, snap)
                    return
                except Exception as exc:
                    log.debug("kv stream: snapshot of %s: %r", iid, exc)
                    await asyncio.sleep(0.5)
            log.warning("kv stream: no snapshot of instance %s (owner gone?)", iid)
            self.index.forget(iid)
        finally:
            self._syncing.discard(iid)


def learn_stored(index: StorageIndex, snap: dict[str, Any]) -> None:
    """A peer's snapshot's stored keys (`storage_block_hashes`) into this daemon's storage
    index, oldest first (the snapshot lists them newest first)."""
    info = snap.get("info") or {}
    model, bs = info.get("model"), snap.get("block_size")
    hexes = snapshot_hex(snap, "storage_block_hashes")
    if model and bs and hexes:
        prefix = f"{model}/{bs}/"
        index.add(prefix + h for h in reversed(hexes))


def learn_storage(index: StorageIndex, batch: dict[str, Any]) -> None:
    """A peer's storage events into this daemon's storage index: a stored chain's keys are
    added, removed ones dropped. Keys are built as the publisher built them (core/storage.py:
    model / block size / hash), from the batch's info and block size; a batch without its
    model (no limits published yet) teaches nothing."""
    info = batch.get("info") or {}
    model, bs = info.get("model"), batch.get("block_size")
    if not model or not bs:
        return
    prefix = f"{model}/{bs}/"
    for ev in batch.get("events", ()):
        if ev.get("medium") != STORAGE:
            continue
        keys = [prefix + h for h in ev.get("block_hashes", ())]
        if ev.get("type") == "BlockStored":
            index.add(keys)
        elif ev.get("type") == "BlockRemoved":
            index.discard(keys)


def snapshot_hex(snap: dict[str, Any], name: str) -> list[str]:
    """A snapshot's hash list `name` as full hex strings (packed or listed), as the storage
    tier's keys name them (`core.storage`: model / block size / hash hex)."""
    packed = snap.get("packed_" + name)
    if packed:
        text = str(packed)
        return [text[i : i + 32] for i in range(0, len(text), 32)]
    return [str(h) for h in snap.get(name) or []]
