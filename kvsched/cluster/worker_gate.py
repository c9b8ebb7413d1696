"""The WorkerService's Hello gate of a cluster daemon (`ClusterNode.admit_worker`).

A worker says Hello for an instance: this daemon owns the instance from then on (its lease,
taken by compare-and-set in the NATS KV bucket) and the worker attaches here, or the gate
answers a Redirect to the live daemon that holds the lease. A lease whose holder is dead
(gone from the membership, or its address refusing connections: `refuses_connections`) is
taken at once, with the same compare-and-set, and the dead daemon's requests with it
(`Takeover.confirmed_dead`). With NATS out of reach the worker attaches here without a lease
(the node degrades to this daemon's own instances).
"""

from __future__ import annotations

import asyncio
import logging
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
        log.info("worker of instance %s redirected to daemon %s", iid, lease.owner)
        return wpb.ConnectResponse(
            redirect=wpb.Redirect(
                address=owner.address,
                owner_daemon_id=lease.owner,
                reason=f"instance {iid} is owned by daemon {lease.owner}",
            )
        ).SerializeToString()

    async def live_member(self, daemon_id: str) -> Member | None:
        """The daemon's membership entry read now (not the polled view: a daemon that just
        joined must not look dead)."""
        if daemon_id == self.node.daemon_id:
            return self.node.membership.me()
        return await self.node.membership.lookup(daemon_id)
