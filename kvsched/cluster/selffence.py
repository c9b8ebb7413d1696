"""Self-fencing: a daemon that cannot refresh its membership stops before its peers take over.

    f = SelfFence(node)      # ClusterNode makes one; its view loop calls f.tick() every 0.2 s
    f.fenced                 # True: route_new refuses new work (UNAVAILABLE, naming why)
    f.reason()               # the refusal's message

A daemon's membership entry lives `member_ttl_s` after its last write; peers take its leases
and adopt its requests soon after it expires. So a daemon whose last successful write
(`Membership.last_put_ok`) is older than `ttl - margin` (margin `ttl / 4`), or whose own loop
stood still that long (SIGSTOP, a stalled host), fences itself, before anyone can adopt what
it runs:

- no new work: `ClusterNode.route_new` refuses new requests (UNAVAILABLE: the client sends
  them to another daemon);
- every request it journaled is parked: taken off its instance (its KV blocks freed, nothing
  written to the journal: its accepted record still names this daemon) and out of the request
  table, and its client's stream is cut (CANCELLED), so a resumable client resumes through
  another daemon (which relays to this one while it looks alive: refused, the journal is out of
  reach; once its entry expired, the adopter serves it).

Unfencing, once a membership write succeeds again: the leases are re-read (`fencing.py` hands
instances a peer took to their new owner), and each parked request is looked up in the journal:
still this daemon's (nobody adopted it) -> back in the table, placed here, its client's next
Resume attaches; adopted elsewhere (the journal's compare-and-set named another daemon) ->
dropped here, never continued. One TTL later the restored ones are looked up again (a peer's
takeover pass that read the expired entry just before this daemon's write can still adopt
them): any adopted meanwhile is parked and dropped then.

Unfenced, every `SWEEP_S` the requests journaled here and parked (their instance was lost: its
lease taken by a peer, its worker gone) are looked up the same way: one a peer adopted (a
takeover of this daemon while it was paused, cut off or taken for dead) is dropped here and its
client's stream cut, so that its Resume finds it at the adopter; one still this daemon's, when
no instance here can take it, is handed over to a peer's instance (`ClusterNode.
hand_over_parked`: that peer adopts it and streams it back here). Issue 23: they waited here
for an instance and ended with an error after requeue_timeout_s.

Only with the journal (the cluster default): without one a request cannot be resumed elsewhere,
and a daemon cut off from NATS keeps serving its own instances (the degraded mode of node.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvsched.core.journal_state import JournalState
from kvsched.server.requests.record import Parked, RemotePeer
from kvsched.server.requests.resume import ParkedSink
from kvsched.v1 import journal_pb2

if TYPE_CHECKING:
    from kvsched.cluster.leases import Leases
    from kvsched.cluster.membership import Membership
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.requests.durable import Durability
    from kvsched.server.requests.record import Tracked
    from kvsched.server.requests.table import RequestTable


class _Node(Protocol):  # what is used of kvsched.cluster.node.ClusterNode
    daemon_id: str
    config: ServerConfig
    requests: RequestTable
    membership: Membership
    leases: Leases

    def hand_over_now(self) -> None: ...

    def hand_over_parked(self, tr: Tracked) -> bool: ...


log = logging.getLogger("kvsched.cluster")

LOOKUP_TIMEOUT_S = 2.0
SWEEP_S = 1.0  # parked requests journaled here are looked up this often (`_sweep_parked`)
_ACCEPTED = journal_pb2.JournalRecord.KIND_ACCEPTED


class SelfFence:
    def __init__(self, node: _Node) -> None:
        self.node = node
        self.durable: Durability | None = None  # the journal's glue: set by the daemon
        ttl = node.config.member_ttl_s
        self.after_s = ttl - ttl / 4  # fence once the entry is older than this
        self.fenced = False
        self.since = 0.0  # monotonic: when this fence began
        self.why = ""
        self.parked: dict[str, Tracked] = {}
        self._recheck: list[tuple[float, list[Tracked]]] = []  # (when, restored requests)
        self._busy = False
        self._sweeping = False  # a sweep of parked requests is running (`_sweep_parked`)
        self._next_sweep = 0.0
        self._sweep: asyncio.Task[None] | None = None
        self._last_tick = 0.0  # monotonic of the last tick (0: none yet)
        self.num_fences = 0
        self.num_parked = 0
        self.num_restored = 0
        self.num_dropped = 0  # adopted elsewhere: never continued here

    @property
    def enabled(self) -> bool:
        return self.durable is not None and self.durable.journal is not None

    def reason(self) -> str:
        ago = time.monotonic() - self.since
        return (
            f"daemon {self.node.daemon_id} is fenced off the cluster ({self.why}, {ago:.1f} s "
            "ago): its instances may be taken over; it takes no new work until NATS answers "
            "again: send the request to another daemon"
        )

    def tick(self) -> None:
        """One check (the node's view loop, every 0.2 s; never blocks)."""
        now = time.monotonic()
        gap = now - self._last_tick if self._last_tick else 0.0  # (a slow start is no pause)
        self._last_tick = now
        age = now - self.node.membership.last_put_ok
        if not self.enabled:
            return
        if not self.fenced:
            if gap > self.after_s:
                self._fence(f"this daemon stood still for {gap:.1f} s")
            elif age > self.after_s:
                self._fence(f"its membership was not refreshed for {age:.1f} s")
        elif age < self.after_s and not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._unfence(), name="unfence")
        if not self.fenced and not self._sweeping and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            if any(_journaled_here(tr) for tr in self.node.requests.parked):
                self._sweeping = True
                loop = asyncio.get_running_loop()
                self._sweep = loop.create_task(self._sweep_parked(), name="adopted-sweep")
        if self._recheck and self._recheck[0][0] <= now and not self._busy:
            _, trs = self._recheck.pop(0)
            self._busy = True
            asyncio.get_running_loop().create_task(self._check_restored(trs), name="refence")

    # ---- fencing ------------------------------------------------------------------------------
    def _fence(self, why: str) -> None:
        self.fenced, self.since, self.why = True, time.monotonic(), why
        self.num_fences += 1
        table = self.node.requests
        n = 0
        for tr in list(table.tracked.values()):
            if (
                tr.finished
                or tr.journal_state != JournalState.STORED
                or type(tr.location) is RemotePeer
            ):
                continue  # not journaled here (a peer's instance runs it: that peer owns it)
            self._park(tr)
            n += 1
        log.warning(
            "self-fenced: %s (limit %.1f s, TTL %g s): no new work; %d request(s) parked, their "
            "clients resume elsewhere",
            why,
            self.after_s,
            self.node.config.member_ttl_s,
            n,
        )

    def _park(self, tr: Tracked, moved: str = "") -> None:
        """Off its instance (KV freed), out of the table, its client's stream cut (with
        `moved`, or the fence's reason); nothing is written to the journal."""
        table = self.node.requests
        rid = tr.req.req_id
        sink = table.set_aside(tr, ParkedSink())
        if hasattr(sink, "moved"):  # a Generate / Resume stream: it ends with UNAVAILABLE
            sink.moved = moved or (
                f"request {rid!r}: daemon {self.node.daemon_id} is fenced off the cluster "
                f"({self.why}); resume it through another daemon"
            )
            sink.notify(tr)
        else:  # a Session: the whole stream ends (its requests are resumed one by one)
            table.streams.discard(sink)
            task = getattr(sink, "task", None)
            if task is not None and not task.done():
                task.cancel()
        self.parked[rid] = tr
        self.num_parked += 1

    # ---- unfencing ----------------------------------------------------------------------------
    async def _owned_here(self, rid: str) -> bool:
        assert self.durable is not None and self.durable.journal is not None
        journal = self.durable.journal
        rec = await asyncio.wait_for(journal.lookup(rid), LOOKUP_TIMEOUT_S)
        return rec is not None and rec.kind == _ACCEPTED and rec.daemon_id == self.node.daemon_id

    async def _unfence(self) -> None:
        node = self.node
        try:
            await asyncio.wait_for(node.leases.reload(), LOOKUP_TIMEOUT_S)
            node.hand_over_now()  # instances a peer took go to it before anything is placed
            keep: list[Tracked] = []
            drop: list[Tracked] = []
            for rid, tr in list(self.parked.items()):
                (keep if await self._owned_here(rid) else drop).append(tr)
        except Exception as exc:  # NATS still flaky: the next tick tries again
            log.info("unfence: %r (retried)", exc)
            self._busy = False
            return
        table = node.requests
        deadline = time.monotonic() + max(table.config.requeue_timeout_s, 1.0)
        for tr in keep:
            rid = tr.req.req_id
            self.parked.pop(rid, None)
            table.take_back(tr, deadline, "self-fenced, then still owned here")
        for tr in drop:
            self._drop(tr)
        if keep:
            table.place_parked()
            self._recheck.append((time.monotonic() + node.config.member_ttl_s, keep))
        self.fenced = False
        self.num_restored += len(keep)
        log.warning(
            "unfenced after %.1f s: %d parked request(s) continue here, %d adopted elsewhere "
            "(dropped here)",
            time.monotonic() - self.since,
            len(keep),
            len(drop),
        )
        self._busy = False

    async def _check_restored(self, trs: list[Tracked]) -> None:
        """Restored requests adopted anyway (a takeover pass raced the unfencing): drop them."""
        table = self.node.requests
        try:
            for tr in trs:
                rid = tr.req.req_id
                if table.tracked.get(rid) is not tr or tr.finished:
                    continue
                if not await self._owned_here(rid):
                    self._park(tr)
                    self._drop(tr)
        except Exception as exc:
            log.info("recheck of restored requests: %r", exc)
        finally:
            self._busy = False

    async def _sweep_parked(self) -> None:
        """Requests journaled here and parked (their instance was lost: its lease taken by a
        peer, its worker gone), looked up in the journal: one a peer adopted meanwhile (a
        takeover of this daemon, which was paused, cut off or taken for dead) is dropped here
        and its client's stream cut, so that its Resume finds it at the adopter, instead of
        waiting here for an instance until requeue_timeout_s and ending with an error."""
        table = self.node.requests
        try:
            for tr in [t for t in table.parked if _journaled_here(t)]:
                rid = tr.req.req_id
                if self.fenced or table.tracked.get(rid) is not tr or tr.finished:
                    continue
                if type(tr.location) is not Parked:
                    continue
                owned = await self._owned_here(rid)
                if table.tracked.get(rid) is not tr or type(tr.location) is not Parked:
                    continue  # placed or ended during the lookup
                if owned:  # still this daemon's: a peer's instance runs it if none here can
                    self.node.hand_over_parked(tr)
                    continue
                self._park(
                    tr,
                    f"request {rid!r} was adopted by another daemon while its instance here "
                    "was lost; resume it through any daemon",
                )
                self._drop(tr)
        except Exception as exc:  # NATS away or slow: the next sweep tries again
            log.info("sweep of parked requests: %r", exc)
        finally:
            self._sweeping = False

    def _drop(self, tr: Tracked) -> None:
        self.parked.pop(tr.req.req_id, None)
        journal = self.durable.journal if self.durable is not None else None
        if journal is not None:
            journal.adopted_elsewhere(tr)  # closed here: the adopter journals it
        self.num_dropped += 1
        log.info("request %s was adopted by another daemon: not continued here", tr.req.req_id)

    def counts(self) -> dict[str, Any]:
        return {
            "fenced": self.fenced,
            "fences": self.num_fences,
            "parked": self.num_parked,
            "restored": self.num_restored,
            "dropped": self.num_dropped,
        }


def _journaled_here(tr: Tracked) -> bool:
    return tr.journal_state == JournalState.STORED and type(tr.location) is Parked
