"""Automatic takeover: a dead daemon's instances and unfinished requests move to live daemons.

    t = Takeover(node, recover)   # recover(dead_id) -> int: Durability.recover (adopt requests)
    t.start()                     # follow node.membership.departures(), scan leases
    await t.take_over(dead_id, instances)   # one pass (also what the loop runs)
    await t.stop()

Trigger: `Membership` reports a daemon whose entry expired (no refresh for `member_ttl_s`: it is
presumed dead). A graceful departure triggers nothing: the leaving daemon drained (every request
finished or aborted, its journal records closed) and released its leases. A scan every
`member_ttl_s` also catches a lease whose owner has no membership entry (a death this daemon
did not see: it started later, or NATS was away when the entry expired).

One pass, on every live daemon that sees the death:
1. the dead daemon's entry is read again (`Membership.lookup`): a daemon restarted under the
   same id recovers its own journal; nothing is taken from it;
2. each of its instances (its last entry's `instances`, and every lease still naming it) is
   taken by `Leases.try_take(iid, from_daemon=dead)`: one compare-and-set on the lease's
   revision, so exactly one daemon wins each instance (a worker's Hello can win it too, the
   same CAS, when the worker reaches a daemon first);
3. a daemon that owns at least one of the dead daemon's instances after step 2 adopts the dead
   daemon's unfinished requests (`recover(dead_id)`, the journal's per-request CAS: with
   several winners, each request goes to whichever claims it first, exactly one). A dead daemon
   with no instance at all is adopted by the live daemon with the smallest id. Adopted requests
   are recomputed on this daemon's instances (prompt + recorded tokens), not necessarily the
   dead daemon's: the KV blocks died with the daemon's view of them anyway (a reattaching
   worker starts from an empty cache).

Every NATS call is bounded (`NATS_TIMEOUT_S`); a pass that fails (NATS away or slow) is
retried at every scan until one completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from kvsched.cluster.membership import Departure

if TYPE_CHECKING:
    from kvsched.cluster.node import ClusterNode

log = logging.getLogger("kvsched.cluster")

NATS_TIMEOUT_S = 5.0  # per call: a loaded NATS or host answers late, never blocks the loop


class Takeover:
    def __init__(self, node: ClusterNode, recover: Callable[[str], Awaitable[int]]) -> None:
        self.node = node
        self.daemon_id = node.daemon_id
        self._recover = recover
        self._task: asyncio.Task[None] | None = None
        self._busy: set[str] = set()  # dead daemon ids with a pass in progress
        self._retry: dict[str, set[str]] = {}  # dead id -> its instances, until a pass completes
        self.num_instances_taken = 0
        self.num_requests_adopted = 0
        self.passes: list[tuple[str, float, int, int]] = []  # dead id, when, instances, requests
        self._idle = asyncio.Event()  # set while no pass runs here
        self._idle.set()
        # dead id -> the pass a confirmed death started, running on, and its leases-moved event
        self._passes: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}

    async def settled(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until no takeover pass runs on this daemon: a Resume of
        a request this daemon is adopting right now is then served from its table."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    def busy(self, dead_id: str) -> bool:
        """Whether a pass for `dead_id` runs on this daemon now."""
        return dead_id in self._busy

    def start(self) -> None:
        q = self.node.membership.departures()
        self._task = asyncio.get_running_loop().create_task(self._loop(q), name="takeover")

    async def stop(self) -> None:
        for task, _ in list(self._passes.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self, q: asyncio.Queue[Departure]) -> None:
        scan_s = self.node.membership.ttl_s
        next_scan = time.monotonic() + scan_s
        while True:
            timeout = max(0.05, next_scan - time.monotonic())
            try:
                dep = await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                dep = None
            if dep is not None and not dep.graceful:
                self._retry[dep.daemon_id] = set(dep.last.instances)
                await self._try(dep.daemon_id)
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + scan_s
                await self._scan()

    async def _try(self, dead_id: str) -> None:
        """A pass for `dead_id`; kept for the next scan until one completes."""
        try:
            await self.take_over(dead_id, self._retry.get(dead_id, ()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NATS away or slow: the next scan tries again
            log.warning("takeover of daemon %s: %r (retried at the next scan)", dead_id, exc)
            return
        self._retry.pop(dead_id, None)

    async def _scan(self) -> None:
        """Leases naming a daemon that has no membership entry: take them over."""
        node = self.node
        if node.membership.stale or not node.connected:
            return
        live = node.membership.members
        dead = {
            lease.owner
            for lease in node.leases.owners().values()
            if lease.owner != self.daemon_id and lease.owner not in live
        }
        for did in sorted(dead | set(self._retry)):
            self._retry.setdefault(did, set())
            await self._try(did)

    async def confirmed_dead(self, dead_id: str, address: str, instances: list[str]) -> None:
        """A live-looking peer proven dead (a worker of its came here and its address refuses
        connections): one pass at once, without waiting for its membership entry to expire.
        Leases still move by CAS and requests by the journal's per-request CAS. Returns once
        the pass has moved the leases (or ended): the worker whose Hello proved the death
        attaches before the dead daemon's requests are adopted, so they are spread over its
        instance too, not only over the instances ready here before (the pass runs on)."""
        log.warning(
            "daemon %s refuses connections at %s: dead; taking over now (before its "
            "membership TTL)",
            dead_id,
            address,
        )
        self._retry.setdefault(dead_id, set()).update(instances)
        loop = asyncio.get_running_loop()
        running = self._passes.get(dead_id)
        if running is None:  # (another of its workers' Hellos started one: wait for that one)
            moved = asyncio.Event()
            task = loop.create_task(
                self._confirmed_pass(dead_id, moved), name=f"takeover-{dead_id}"
            )
            running = self._passes[dead_id] = (task, moved)
            task.add_done_callback(lambda _t: self._passes.pop(dead_id, None))
        task, moved = running
        waiter = loop.create_task(moved.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    async def _confirmed_pass(self, dead_id: str, moved: asyncio.Event) -> None:
        try:
            await self.take_over(dead_id, self._retry[dead_id], force=True, moved=moved)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NATS away or slow: the next scan (or the TTL) retries
            log.warning("takeover of daemon %s: %r (retried at the next scan)", dead_id, exc)
            return
        self._retry.pop(dead_id, None)

    async def take_over(
        self,
        dead_id: str,
        instances: Iterable[str],
        force: bool = False,
        moved: asyncio.Event | None = None,
    ) -> tuple[int, int]:
        """One pass for `dead_id` (see the module docstring): (instances won by this call,
        requests adopted). `force` (`serve --take-over`, the operator says it is dead): no
        liveness check, and its requests are adopted whatever the leases say. `moved` is set
        once step 2 is done (the leases moved), before the requests are adopted."""
        if dead_id == self.daemon_id or dead_id in self._busy:
            return 0, 0
        self._busy.add(dead_id)
        self._idle.clear()
        try:
            return await self._pass(dead_id, set(instances), force, moved)
        finally:
            self._busy.discard(dead_id)
            if not self._busy:
                self._idle.set()

    async def _pass(
        self, dead_id: str, instances: set[str], force: bool, moved: asyncio.Event | None
    ) -> tuple[int, int]:
        node = self.node
        if not force and (
            await asyncio.wait_for(node.membership.lookup(dead_id), NATS_TIMEOUT_S) is not None
        ):
            return 0, 0  # alive (restarted under its id): it recovers its own journal
        instances |= {i for i, lease in node.leases.owners().items() if lease.owner == dead_id}
        won, mine = 0, 0
        for iid in sorted(instances):
            if await asyncio.wait_for(node.leases.try_take(iid, dead_id), NATS_TIMEOUT_S):
                won += 1
            lease = await asyncio.wait_for(node.leases.owner(iid), NATS_TIMEOUT_S)
            mine += lease is not None and lease.owner == self.daemon_id
        if not instances:  # no instance to decide by: the smallest live id adopts
            live = set(node.membership.members) | {self.daemon_id}
            mine = int(min(live) == self.daemon_id)
        if moved is not None:
            moved.set()
            await asyncio.sleep(0)  # a worker waiting on `moved` attaches before the adoption
        adopted = await self._recover(dead_id) if mine or force else 0
        self.num_instances_taken += won
        self.num_requests_adopted += adopted
        if won or adopted:
            self.passes.append((dead_id, time.time(), won, adopted))
            # Operators (and the tests) read this line: the same words as `--take-over`'s.
            print(
                f"kvsched took over {adopted} request(s) of daemon {dead_id} "
                f"({won} of its instance lease(s) moved here by this pass)",
                flush=True,
            )
        return won, adopted
