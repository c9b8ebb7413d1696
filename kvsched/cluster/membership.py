"""Cluster membership: which daemons are alive, where they listen, what they drive.

One JetStream KV bucket, `kvsched_members`, one entry per daemon (key: the daemon id), value a
JSON `Member`: `{"daemon_id", "address", "instances", "load", "started_at"}` where `load` maps
each instance the daemon drives to its load summary (`running`, `waiting`, `queued_prefill_tokens`,
`kv_usage`, `max_num_seqs`). The bucket's TTL (`ttl_s`) removes the entry of a daemon that stopped
refreshing it; a daemon rewrites its entry every `ttl_s / 4`, and marks it `"leaving": true`
when it stops (a graceful departure; the TTL removes it later).

Public API (`takeover.py` follows the departures):

    m = Membership(link, address="10.0.0.5:50051", ttl_s=6.0, load=callable_returning_dict)
    await m.start()                   # first entry written, refresh + poll loop running
    m.members  -> dict[str, Member]   # the live daemons as of the last poll (self included)
    m.alive(daemon_id) -> bool        # in the polled view
    await m.lookup(daemon_id)         # its entry read now (None: expired or leaving)
    q = m.departures()                # asyncio.Queue[Departure]: one item per daemon that left
                                      #   (graceful: marked `leaving`) or expired (its entry
                                      #   timed out: graceful False, the takeover case)
    await m.refresh()                 # write this daemon's entry and poll the bucket now
    await m.stop()                    # stop the loop; the entry says `leaving`

Departures are found by polling the bucket every `poll_s` (min(ttl_s / 4, 0.5 s); JetStream does
not notify watchers of an entry removed by TTL), and in between by reading its key list alone
every `EXPIRY_CHECK_S` (0.1 s; a member's key gone: a full poll at once), so a daemon learns of
a peer's expiry at most ~0.1 s after NATS removed its entry (~0.25 s after its TTL). The poll lists the bucket's keys from its stream's
subjects (`ClusterLink.keys_of`: no consumer per poll) and always counts this daemon itself
once its own write succeeded. `last_put_ok` (monotonic) is when this daemon's entry was last
written: `selffence.py` fences the daemon when it grows older than the safety margin. While NATS is unreachable the loop keeps trying; `members` keeps its
last view (`stale` is True) and no departure is reported from a stale view, nor for one TTL
after NATS is back (peers need that long to write their entries again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from kvsched.cluster.link import ClusterLink
from kvsched.core.errors import Unavailable

log = logging.getLogger("kvsched.cluster")

MEMBERS_BUCKET = "kvsched_members"
# Between two full polls (`poll_s`), the bucket's key list alone is read this often: a peer
# whose entry NATS removed (~0.25 s after its TTL) is seen gone within this long, not within
# `poll_s` (0.5 s: the takeover of a paused daemon waited up to that long more, issue 38).
# One stream-info request each: no entry is read or written.
EXPIRY_CHECK_S = 0.1


@dataclass
class Member:
    daemon_id: str
    address: str  # HOST:PORT workers and peers reach the daemon at
    instances: list[str] = field(default_factory=list)
    load: dict[str, dict[str, float]] = field(default_factory=dict)
    started_at: float = 0.0  # wall-clock seconds
    leaving: bool = False  # written once by a daemon that stops: a graceful departure

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Member:
        d = json.loads(data)
        return cls(
            daemon_id=str(d["daemon_id"]),
            address=str(d["address"]),
            instances=[str(i) for i in d.get("instances", [])],
            load={str(k): dict(v) for k, v in d.get("load", {}).items()},
            started_at=float(d.get("started_at", 0.0)),
            leaving=bool(d.get("leaving", False)),
        )


@dataclass(frozen=True)
class Departure:
    daemon_id: str
    graceful: bool  # it deleted its entry (False: the entry expired: the daemon is presumed dead)
    last: Member  # its last entry seen


class Membership:
    def __init__(
        self,
        link: ClusterLink,
        address: str,
        ttl_s: float = 6.0,
        summary: Callable[[], tuple[list[str], dict[str, dict[str, float]]]] | None = None,
    ) -> None:
        self.link = link
        self.daemon_id = link.daemon_id
        self.address = address
        self.ttl_s = ttl_s
        self.refresh_s = ttl_s / 4
        self.poll_s = min(self.refresh_s, 0.5)
        self.last_put_ok = time.monotonic()  # this daemon's entry was last written then
        self._summary = summary  # (instances, load per instance) of this daemon, at refresh
        self.members: dict[str, Member] = {}
        self.stale = True  # the last poll failed (NATS unreachable)
        self.started_at = time.time()
        self._kv: KeyValue | None = None
        self._queues: list[asyncio.Queue[Departure]] = []
        self._task: asyncio.Task[None] | None = None
        self._left: set[str] = set()  # ids whose entry says `leaving`, at the last poll
        self._grace_until = 0.0  # after an outage: no expiry is believed before this
        # daemon id -> (its entry's revision, when this daemon saw that revision first)
        self._changed: dict[str, tuple[int, float]] = {}
        # daemon id -> its address, for daemons whose entry expired (presumed dead) and that
        # have not written one since: calls to them are given up (ClusterNode.silent_at).
        self.expired: dict[str, str] = {}
        self._wake = asyncio.Event()  # refresh now (set after a NATS reconnect)
        link.on_reconnect.append(self._wake.set)

    async def start(self) -> None:
        self._kv = await self.link.bucket(MEMBERS_BUCKET, ttl_s=self.ttl_s)
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="membership")

    async def lookup(self, daemon_id: str) -> Member | None:
        """A daemon's entry read from NATS now: None when it has none (expired) or it says
        `leaving`. Raises Unavailable when NATS cannot be asked (never guess "dead")."""
        assert self._kv is not None, "Membership.start() was not called"
        try:
            entry = await self._kv.get(daemon_id)
        except KeyNotFoundError:
            return None
        except Exception as exc:
            raise Unavailable(f"membership of {daemon_id!r}: NATS: {exc}") from None
        if not entry.value:
            return None
        member = Member.from_json(entry.value)
        return None if member.leaving else member

    def alive(self, daemon_id: str) -> bool:
        return daemon_id in self.members

    def silent_for(self, daemon_id: str) -> float:
        """Seconds since this daemon last saw `daemon_id`'s entry change (every live daemon
        rewrites it every `poll_s`); 0 when unknown or while this daemon's own view is stale."""
        seen = self._changed.get(daemon_id)
        if seen is None or self.stale or daemon_id == self.daemon_id:
            return 0.0
        return time.monotonic() - seen[1]

    def departures(self) -> asyncio.Queue[Departure]:
        """A queue that receives every departure seen from now on (one queue per caller)."""
        q: asyncio.Queue[Departure] = asyncio.Queue()
        self._queues.append(q)
        return q

    def me(self) -> Member:
        instances, load = self._summary() if self._summary is not None else ([], {})
        return Member(self.daemon_id, self.address, instances, load, self.started_at)

    async def refresh(self) -> None:
        """Write this daemon's entry, then read everyone's; departures go to the queues."""
        kv = self._kv
        assert kv is not None, "Membership.start() was not called"
        self._left = set()
        bound = max(1.0, self.refresh_s)
        try:
            me = self.me()
            await asyncio.wait_for(kv.put(self.daemon_id, me.to_json()), bound)
            self.last_put_ok = time.monotonic()
            seen = await asyncio.wait_for(self._read_all(kv), bound)
            seen.setdefault(self.daemon_id, me)  # written just now: never "expired" to itself
        except Exception as exc:  # NATS down or restarting: keep the last view
            if not self.stale:
                log.warning("membership: cannot reach NATS (%s); keeping the last view", exc)
            self.stale = True
            return
        now = time.monotonic()
        if self.stale and self.members:
            log.info("membership: NATS reachable again, %d daemon(s)", len(seen))
            # Peers refresh within a TTL of NATS coming back: until then an entry that
            # expired during the outage is no sign of a dead daemon.
            self._grace_until = now + self.ttl_s
        self.stale = False
        old = self.members
        if now < self._grace_until:
            for did, last in old.items():
                if did not in seen and did not in self._left:
                    seen[did] = last
        self.members = seen
        for did in seen:
            self.expired.pop(did, None)
        for did, last in old.items():
            if did not in seen:
                dep = Departure(did, did in self._left, last)
                if not dep.graceful:
                    self.expired[did] = last.address
                log.info(
                    "daemon %s %s",
                    did,
                    "left the cluster" if dep.graceful else "expired (no refresh)",
                )
                for q in self._queues:
                    q.put_nowait(dep)

    async def _read_all(self, kv: KeyValue) -> dict[str, Member]:
        keys = await self.link.keys_of(MEMBERS_BUCKET)
        out: dict[str, Member] = {}
        for key in keys:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            if entry.value:
                rev, now = entry.revision or 0, time.monotonic()
                if self._changed.get(key, (-1, 0.0))[0] != rev:
                    self._changed[key] = (rev, now)
                try:
                    member = Member.from_json(entry.value)
                except (ValueError, KeyError) as exc:
                    log.warning("membership: unreadable entry %r: %s", key, exc)
                    continue
                if member.leaving:
                    self._left.add(key)
                else:
                    out[key] = member
        return out

    async def _loop(self) -> None:
        last = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(self.poll_s, EXPIRY_CHECK_S))
            early = not self._wake.is_set() and time.monotonic() - last < self.poll_s
            if early and not await self._member_gone():
                continue  # a full poll is not due, and no member's key is gone
            self._wake.clear()
            last = time.monotonic()
            await self.refresh()

    async def _member_gone(self) -> bool:
        """Whether a member of the last view has no key in the bucket any more (read from its
        stream's subjects, one request); False when NATS does not answer (the full poll
        tells)."""
        peers = [did for did in self.members if did != self.daemon_id]
        if not peers or self.stale or time.monotonic() < self._grace_until:
            return False  # (within the grace after an outage a gone key is no departure)
        try:
            keys = set(await asyncio.wait_for(self.link.keys_of(MEMBERS_BUCKET), 1.0))
        except Exception:
            return False
        return any(did not in keys for did in peers)

    async def stop(self) -> None:
        """Stop refreshing and mark this daemon's entry `leaving` (peers see a graceful
        departure; the bucket's TTL removes the entry later)."""
        with contextlib.suppress(ValueError):
            self.link.on_reconnect.remove(self._wake.set)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._kv is not None:
            me = self.me()
            me.leaving = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._kv.put(self.daemon_id, me.to_json()), 2.0)
