"""KV events and load over NATS: publish this daemon's instances, index everyone's.

    engines' schedulers --take_kv_events (every flush_s)--> KvStream.flush --> NATS subject
    kvsched.kv.events.<instance>  --every daemon's subscription--> ClusterIndex.apply_batch
                                                        gap / unknown epoch --> snapshot request
    kvsched.kv.snapshot.<instance> <-- the owner answers from its scheduler (after a flush)

The wire format is in `kv_index.py` and docs/CLUSTER.md. A batch is published for an instance
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
from collections.abc import Callable
from typing import Any

from kvsched.cluster.kv_index import (
    EVENTS_SUBJECT,
    SNAPSHOT_SUBJECT,
    ClusterIndex,
    decode,
    encode_batch,
    encode_snapshot,
)
from kvsched.cluster.link import ClusterLink
from kvsched.core import Scheduler

log = logging.getLogger("kvsched.cluster")


def load_of(sched: Scheduler) -> dict[str, float]:
    """An instance's load summary: what the router and the membership entry carry."""
    # The waiting queue, not every request of the instance: this runs at each publish.
    queued = sum(req.num_tokens - req.num_computed_tokens for req in sched.waiting)
    a_tok, a_attn = sched.cost.prefill_costs
    return {
        "running": float(sched.num_running),
        "waiting": float(sched.num_waiting),
        "max_num_seqs": float(sched.config.scheduler.max_num_seqs),
        "kv_usage": round(sched.kv.usage, 4),
        "queued_prefill_tokens": float(queued),
        "predicted_backlog_ms": round(sched.predicted_backlog_ms(), 3),
        # The step-cost model peers price this instance's hits with (recompute vs swap-in).
        "prefill_token_ms": a_tok,
        "attention_ms": a_attn,
        "swap_block_ms": sched.cost.swap_block_ms,
    }


def host_block_hashes(sched: Scheduler) -> list[bytes]:
    """Every hash the instance's host-memory tier holds now ([] without one)."""
    host = sched.kv.host
    return list(host.pool.cached) if host is not None else []


class _Pub:
    """One instance's publishing state: the scheduler it reads, its epoch and seq."""

    __slots__ = ("epoch", "last_sent", "sched", "seq")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self.last_sent = 0.0


class KvStream:
    def __init__(
        self,
        link: ClusterLink,
        schedulers: Callable[[], dict[str, Scheduler]],
        flush_s: float = 0.02,
        load_every_s: float = 0.25,
    ) -> None:
        self.link = link
        self.daemon_id = link.daemon_id
        self._schedulers = schedulers  # this daemon's ready instances and their schedulers
        self.flush_s = flush_s
        self.load_every_s = load_every_s
        self.index = ClusterIndex()
        self._pubs: dict[str, _Pub] = {}
        self._subs: list[Any] = []
        self._task: asyncio.Task[None] | None = None
        self._syncing: set[str] = set()
        self.num_published = 0
        self.drop_next = False  # tests: drop the next batch instead of publishing it
        # An instance's model and limits, published with its load (None: not published).
        self.info_of: Callable[[str], dict[str, Any] | None] | None = None

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
        scheds = self._schedulers()
        for iid in [i for i in self._pubs if i not in scheds]:
            del self._pubs[iid]
        for iid, sched in scheds.items():
            if only is not None and iid != only:
                continue
            pub = self._pubs.get(iid)
            if pub is None or pub.sched is not sched:
                pub = self._pubs[iid] = _Pub(sched)
                sched.enable_kv_events()
            events = sched.take_kv_events()
            # Load rides with every event batch, alone at least every load_every_s: it is not
            # computed (a scan of the queue and the cost model) on the flushes that send nothing.
            if not events and now - pub.last_sent < self.load_every_s:
                continue
            load = load_of(sched)
            pub.seq += 1
            data = encode_batch(
                iid,
                self.daemon_id,
                pub.epoch,
                pub.seq,
                time.time(),
                sched.block_size,
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
        sched = self._schedulers().get(iid)
        if sched is None or not msg.reply:
            return  # not ours: the owner answers
        await self.flush(only=iid)  # what is recorded goes out first: the snapshot follows it
        pub = self._pubs[iid]
        data = encode_snapshot(
            iid,
            self.daemon_id,
            pub.epoch,
            pub.seq,
            sched.block_size,
            load_of(sched),
            sched.cached_block_hashes(),
            self._info(iid),
            host_block_hashes(sched),
        )
        with contextlib.suppress(Exception):
            await msg.respond(data)

    # ---- the index --------------------------------------------------------------------------
    async def _on_batch(self, msg: Any) -> None:
        try:
            batch = decode(msg.data)
        except ValueError as exc:
            log.warning("kv stream: unreadable batch on %s: %s", msg.subject, exc)
            return
        if not self.index.apply_batch(batch, time.monotonic()):
            self.sync(str(batch["instance"]))

    async def _fetch(self, iid: str) -> None:
        try:
            for _ in range(20):
                try:
                    reply = await self.link.nc.request(
                        f"{SNAPSHOT_SUBJECT}.{iid}", b"", timeout=1.0
                    )
                    self.index.apply_snapshot(decode(reply.data), time.monotonic())
                    return
                except Exception as exc:
                    log.debug("kv stream: snapshot of %s: %r", iid, exc)
                    await asyncio.sleep(0.5)
            log.warning("kv stream: no snapshot of instance %s (owner gone?)", iid)
            self.index.forget(iid)
        finally:
            self._syncing.discard(iid)
