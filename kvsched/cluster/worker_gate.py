"""The WorkerService's Hello gate of a cluster daemon (`ClusterNode.admit_worker`).

A worker says Hello for an instance: this daemon owns the instance from then on (its lease,
taken by compare-and-set in the NATS KV bucket) and the worker attaches here, or the gate
answers a Redirect to the live daemon that holds the lease. A lease whose holder is dead
(gone from the membership, or its address refusing connections: `refuses_connections`) is
taken at once, with the same compare-and-set, and the dead daemon's requests with it
(`Takeover.confirmed_dead`). A lease whose holder is alive but silent (its membership entry
not refreshed for a refresh period: paused, hung, cut off from NATS) keeps the worker here
(`_hold`: redirected to this daemon again each time its silence bound nears) until the lease
moves (the takeover after its TTL: the worker attaches at once where the lease now is, before
the dead daemon's requests are placed) or the holder is heard again (redirected to it): sent
to a paused holder, the worker spent its silence bound there round after round, and the
takeover found it away. With NATS out of reach the worker attaches here without a lease (the
node degrades to this daemon's own instances).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from kvsched.cluster.cluster_view import refuses_connections
from kvsched.core import Unavailable
from kvsched.v1 import worker_service_pb2 as wpb

if TYPE_CHECKING:
    from kvsched.cluster.leases import Leases
    from kvsched.cluster.membership import Member, Membership
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.instances.registry import InstanceRegistry

log = logging.getLogger("kvsched.cluster")

NATS_TIMEOUT_S = 2.0
# A worker whose instance's daemon is silent waits here (`WorkerGate._hold`) this long at most
# per Hello, and less than its silence bound by HOLD_MARGIN_S; its owner's silence is looked at
# this often (a change of its lease wakes it at once: `Leases.changed`).
HOLD_S = 5.0
HOLD_MARGIN_S = 0.5
HOLD_POLL_S = 0.05


class _Takeover(Protocol):
    async def confirmed_dead(self, dead_id: str, address: str, instances: list[str]) -> None: ...


class _Node(Protocol):
    """What the gate reads of the cluster node (read at each Hello: `takeover` is set late)."""

    daemon_id: str
    registry: InstanceRegistry
    config: ServerConfig
    leases: Leases
    membership: Membership

    @property
    def connected(self) -> bool: ...

    @property
    def takeover(self) -> _Takeover | None: ...


class WorkerGate:
    def __init__(self, node: _Node) -> None:
        self.node = node

    async def admit(self, hello: Any) -> bytes | None:
        """None: attach the worker here (this daemon owns its instance now). Otherwise the
        serialized ConnectResponse redirecting it to the owner."""
        iid = hello.instance_id
        eng = self.node.registry.engines.get(iid)
        if eng is not None and eng.ranks:
            return None  # another rank of it is attached here already: it is ours
        if eng is None and not self.node.config.auto_instances:
            return None  # an instance this daemon does not know: attach refuses it, no lease
        if not self.node.connected:
            log.warning("NATS unreachable: attaching instance %s here without a lease", iid)
            return None
        try:
            lease = await asyncio.wait_for(self.node.leases.acquire(iid), NATS_TIMEOUT_S)
            if lease.owner == self.node.daemon_id:
                return None
            owner = await self.live_member(lease.owner)
            if owner is None:  # its owner is gone: take it (one CAS; a racing daemon may win)
                if await asyncio.wait_for(
                    self.node.leases.try_take(iid, lease.owner), NATS_TIMEOUT_S
                ):
                    return None
                lease2 = await self.node.leases.owner(iid)
                if lease2 is None or lease2.owner == self.node.daemon_id:
                    return None if lease2 is not None else await self.admit(hello)
                lease, owner = lease2, await self.live_member(lease2.owner)
                if owner is None:
                    raise Unavailable(f"instance {iid}: its lease is moving; retry")
            if self.node.takeover is not None and await refuses_connections(owner.address):
                # Its worker came here and its address refuses connections: it is dead. Take
                # its leases and requests now (by CAS), not after its membership TTL.
                await self.node.takeover.confirmed_dead(lease.owner, owner.address, owner.instances)
                again = await asyncio.wait_for(self.node.leases.owner(iid), NATS_TIMEOUT_S)
                if again is not None and again.owner == self.node.daemon_id:
                    return None
        except (TimeoutError, Unavailable) as exc:
            raise Unavailable(f"instance {iid}: cluster lease unavailable: {exc}") from None
        if self._silent(lease.owner):
            if await self._hold(iid, lease.owner):
                return await self.admit(hello)  # its lease moved, or its owner is back
            me = self.node.membership.address
            log.info("worker of instance %s waits here: its daemon %s is silent", iid, lease.owner)
            return wpb.ConnectResponse(
                redirect=wpb.Redirect(
                    address=me,
                    owner_daemon_id=lease.owner,
                    reason=f"instance {iid}'s daemon {lease.owner} has missed its membership "
                    "heartbeats: wait here (Hello again) until its lease moves",
                )
            ).SerializeToString()
        log.info("worker of instance %s redirected to daemon %s", iid, lease.owner)
        return wpb.ConnectResponse(
            redirect=wpb.Redirect(
                address=owner.address,
                owner_daemon_id=lease.owner,
                reason=f"instance {iid} is owned by daemon {lease.owner}",
            )
        ).SerializeToString()

    def _silent(self, daemon_id: str) -> bool:
        """Whether `daemon_id` has missed its membership refreshes lately (no new entry seen
        for a refresh period: a live daemon writes one every poll, 0.5 s at most)."""
        membership = self.node.membership
        return daemon_id != self.node.daemon_id and membership.silent_for(daemon_id) > max(
            1.0, membership.refresh_s
        )

    async def _hold(self, iid: str, owner_id: str) -> bool:
        """Keep a worker whose instance's lease names a silent daemon here instead of sending
        it there (a paused daemon holds it until the worker's silence bound, round after
        round, and the takeover then finds it away): True as soon as the lease names another
        daemon (a takeover moved it) or the owner refreshes again; False after HOLD (less than
        the silence bound this daemon's Welcome gives its workers, which they keep before a
        Welcome too), when the caller redirects the worker here again."""
        cfg = self.node.config
        bound = cfg.silence_timeout_intervals * cfg.heartbeat_interval_s
        until = time.monotonic() + max(HOLD_POLL_S, min(HOLD_S, bound - HOLD_MARGIN_S))
        while time.monotonic() < until:
            await self.node.leases.changed(HOLD_POLL_S)  # woken by the takeover's lease write
            if self.node.leases.cached_owner(iid) != owner_id or not self._silent(owner_id):
                return True
        return False

    async def live_member(self, daemon_id: str) -> Member | None:
        """The daemon's membership entry read now (not the polled view: a daemon that just
        joined must not look dead)."""
        if daemon_id == self.node.daemon_id:
            return self.node.membership.me()
        return await self.node.membership.lookup(daemon_id)
