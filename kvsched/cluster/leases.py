"""Instance leases: which daemon owns each instance, moved only by compare-and-set.

One JetStream KV bucket, `kvsched_leases`, one entry per instance (key: the instance id), value
the owning daemon's id (UTF-8). Entries never expire: a lease is created with `create` (fails if
the key exists) and moved with `update(last=revision)` (fails if anyone changed it since that
revision), so two daemons racing for one instance cannot both win: exactly one owner at a time.
A daemon that leaves gracefully deletes its leases (also by revision). A dead daemon's leases
stay until a live daemon takes them with `try_take` (`takeover.py` does that when
`Membership` reports the owner expired; a worker's Hello does it for its own instance).

Public API:

    leases = Leases(link)
    await leases.start()                      # open the bucket, start watching it
    lease = await leases.owner(iid)           # Lease(instance_id, owner, revision) or None
    leases.cached_owner(iid)                  # the watcher's latest view, no round trip
    leases.owners() -> dict[str, Lease]       # every lease as the watcher saw it last
    leases.epoch(iid)                         # this daemon's fencing epoch for it (0: not ours)
    await leases.reload()                     # re-read every lease (after an outage)
    got = await leases.acquire(iid)           # the lease after trying to create it for this
                                              #   daemon: got.owner tells who won
    ok = await leases.try_take(iid, from_daemon)  # CAS: True only if it moved from
                                              #   `from_daemon` (or from nobody, when
                                              #   from_daemon is None) to this daemon
    ok = await leases.release(iid)            # delete this daemon's lease (CAS on revision)
    await leases.stop()

`try_take` and `acquire` read the current entry and write with its revision in one CAS; a lost
race returns False / the winner's lease, never raises. NATS errors other than a lost race
propagate (`Unavailable` when NATS cannot be reached).

Fencing: a lease's revision is its epoch. Revisions are the bucket stream's sequence numbers,
so each create/update of any key is larger than every earlier one: a daemon that acquires a
lease holds a larger epoch than every earlier holder of it. The daemon stamps it on Welcome and
Tasks (protocol step 12) and workers refuse a lower one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from nats.js.errors import Error as JsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from kvsched.cluster.link import ClusterLink
from kvsched.core.errors import Unavailable

log = logging.getLogger("kvsched.cluster")

LEASES_BUCKET = "kvsched_leases"
WATCH_INACTIVE_S = 10.0  # the server drops a watcher's consumer unused this long
_PUT, _DEL, _PURGE = "PUT", "DEL", "PURGE"


@dataclass(frozen=True)
class Lease:
    instance_id: str
    owner: str  # daemon id
    revision: int


class Leases:
    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self.daemon_id = link.daemon_id
        self._kv: KeyValue | None = None
        self._cache: dict[str, Lease] = {}
        self._watch: asyncio.Task[None] | None = None
        self._restart = asyncio.Event()
        self.num_watchers = 0  # watchers replaced (one per NATS reconnect)
        self._waiters: list[asyncio.Event] = []  # `changed` callers, woken at the next change
        link.on_reconnect.append(self._restart_watcher)

    async def start(self) -> None:
        self._kv = await self.link.bucket(LEASES_BUCKET)
        await self.reload()
        self._watch = asyncio.get_running_loop().create_task(self._watcher(), name="leases")

    async def reload(self) -> None:
        """Read every lease from NATS into the cache (start, and after an outage: a watcher
        may miss what changed while the server was away)."""
        fresh: dict[str, Lease] = {}
        for key in await self.link.keys_of(LEASES_BUCKET):  # no consumer (see keys_of)
            with contextlib.suppress(KeyNotFoundError):
                entry = await self.kv.get(key)
                if entry.value:
                    fresh[key] = Lease(key, entry.value.decode(), entry.revision or 0)
        for key, lease in self._cache.items():  # a newer one the watcher delivered meanwhile
            if key in fresh and lease.revision > fresh[key].revision:
                fresh[key] = lease
        self._cache = fresh

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.link.on_reconnect.remove(self._restart_watcher)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    @property
    def kv(self) -> KeyValue:
        assert self._kv is not None, "Leases.start() was not called"
        return self._kv

    # ---- reads ------------------------------------------------------------------------------
    async def owner(self, instance_id: str) -> Lease | None:
        """The instance's lease as NATS has it now (None: nobody owns it)."""
        try:
            entry = await self.kv.get(instance_id)
        except KeyNotFoundError:
            self._cache.pop(instance_id, None)
            return None
        except JsError as exc:
            raise Unavailable(f"lease of {instance_id!r}: NATS: {exc}") from None
        if not entry.value:
            return None
        lease = Lease(instance_id, entry.value.decode(), entry.revision or 0)
        self._note(lease)
        return lease

    def cached_owner(self, instance_id: str) -> str | None:
        lease = self._cache.get(instance_id)
        return None if lease is None else lease.owner

    def owners(self) -> dict[str, Lease]:
        return dict(self._cache)

    def epoch(self, instance_id: str) -> int:
        """This daemon's fencing epoch for the instance: its lease's revision in the bucket (a
        JetStream stream sequence, so every acquisition yields a strictly larger one), as the
        cache has it; 0 when the lease is not this daemon's (or unknown: NATS away)."""
        lease = self._cache.get(instance_id)
        return lease.revision if lease is not None and lease.owner == self.daemon_id else 0

    def cached(self, instance_id: str) -> Lease | None:
        return self._cache.get(instance_id)

    # ---- compare-and-set --------------------------------------------------------------------
    async def acquire(self, instance_id: str) -> Lease:
        """Create the lease for this daemon if nobody holds it; the lease as it stands after
        (this daemon's, or the owner's that was there first or won the race)."""
        try:
            rev = await self.kv.create(instance_id, self.daemon_id.encode())
        except KeyWrongLastSequenceError:
            lease = await self.owner(instance_id)
            if lease is not None:
                return lease
            # Deleted between the create and the read: the key has a delete marker now, which
            # `create` also refuses; take it from nobody by revision.
            if await self.try_take(instance_id, None):
                got = self._cache.get(instance_id)
                assert got is not None
                return got
            lease = await self.owner(instance_id)
            if lease is None:
                raise Unavailable(f"lease of {instance_id!r} keeps changing; retry") from None
            return lease
        lease = Lease(instance_id, self.daemon_id, rev)
        self._note(lease)
        return lease

    async def try_take(self, instance_id: str, from_daemon: str | None) -> bool:
        """Move the lease to this daemon iff its owner is `from_daemon` now (None: nobody owns
        it); one CAS on the entry's revision. True when this daemon owns it after the call
        because of this call."""
        kv = self.kv
        try:
            entry = await kv.get(instance_id)
            current, rev = (entry.value or b"").decode() or None, entry.revision
        except KeyNotFoundError as exc:
            # Never created, or deleted (then the delete marker has a revision to CAS on).
            current, rev = None, (exc.entry.revision if exc.entry is not None else None)
        if current != from_daemon:
            return False
        try:
            if rev is None:
                new_rev = await kv.create(instance_id, self.daemon_id.encode())
            else:
                new_rev = await kv.update(instance_id, self.daemon_id.encode(), last=rev)
        except KeyWrongLastSequenceError:
            return False
        self._note(Lease(instance_id, self.daemon_id, new_rev))
        log.info("lease of instance %s taken from %s", instance_id, from_daemon or "nobody")
        return True

    async def release(self, instance_id: str) -> bool:
        """Delete this daemon's lease on the instance (CAS on its revision); False when the
        lease is not this daemon's (any more)."""
        lease = await self.owner(instance_id)
        if lease is None or lease.owner != self.daemon_id:
            return False
        try:
            await self.kv.delete(instance_id, last=lease.revision)
        except JsError:  # the revision moved on: someone else's lease now
            return False
        self._cache.pop(instance_id, None)
        return True

    async def changed(self, timeout_s: float) -> None:
        """Return once the cache changed (a lease taken, moved or released, as this daemon's
        watcher or its own calls saw it), or after `timeout_s`."""
        ev = asyncio.Event()
        self._waiters.append(ev)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), timeout_s)
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(ev)

    # ---- the watcher ------------------------------------------------------------------------
    def _note(self, lease: Lease) -> None:
        have = self._cache.get(lease.instance_id)
        if have is None or have.revision <= lease.revision:
            if have is None or have.owner != lease.owner:
                self._wake()
            self._cache[lease.instance_id] = lease

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for ev in waiters:
            ev.set()

    def _restart_watcher(self) -> None:
        """After a NATS reconnect: a new watcher (the old one's ordered consumer may be gone
        on the server, or stalled; it is stopped, so consumers do not pile up)."""
        self._restart.set()

    async def _watcher(self) -> None:
        """Keep `owners()` current from the bucket's updates (across NATS reconnects: the
        watcher is replaced after each, and the server drops an unused one's consumer after
        WATCH_INACTIVE_S)."""
        while True:
            watcher = None
            self._restart.clear()
            try:
                watcher = await self.kv.watchall(inactive_threshold=WATCH_INACTIVE_S)
                while not self._restart.is_set():
                    restart = asyncio.ensure_future(self._restart.wait())
                    # nats-py's KeyWatcher methods are unannotated (no types to check against).
                    updates = watcher.updates(timeout=None)  # type: ignore[no-untyped-call]
                    update = asyncio.ensure_future(updates)
                    done, _ = await asyncio.wait(
                        {restart, update}, return_when=asyncio.FIRST_COMPLETED
                    )
                    restart.cancel()
                    if update not in done:
                        update.cancel()
                        break
                    entry = update.result()
                    if entry is None:
                        continue  # end of the initial values
                    if entry.operation in (_DEL, _PURGE) or not entry.value:
                        have = self._cache.get(entry.key)
                        if have is not None and have.revision <= (entry.revision or 0):
                            del self._cache[entry.key]
                            self._wake()
                    else:
                        self._note(Lease(entry.key, entry.value.decode(), entry.revision or 0))
            except asyncio.CancelledError:
                if watcher is not None:  # its subscription would hold up the link's drain
                    with contextlib.suppress(Exception):
                        stop = watcher.stop()  # type: ignore[no-untyped-call]  # nats-py: unannotated
                        await asyncio.wait_for(stop, 1.0)
                raise
            except Exception as exc:
                log.debug("leases watcher: %r; restarting", exc)
                await asyncio.sleep(0.5)
            if watcher is not None:
                with contextlib.suppress(Exception):
                    stop = watcher.stop()  # type: ignore[no-untyped-call]  # nats-py: unannotated
                    await asyncio.wait_for(stop, 1.0)
                with contextlib.suppress(Exception):  # its consumer now, not after the threshold
                    await asyncio.wait_for(self._drop_consumer(watcher), 1.0)
            self.num_watchers += 1

    async def _drop_consumer(self, watcher: Any) -> None:
        sub = getattr(watcher, "_sub", None)
        stream, name = getattr(sub, "_stream", None), getattr(sub, "_consumer", None)
        if stream and name:
            await self.link.js.delete_consumer(stream, name)
