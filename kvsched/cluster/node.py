"""This daemon as a member of a cluster: the parts of kvsched.cluster, wired to the daemon.

    ClusterNode.start: Membership (this daemon's entry: address, instances, load), Leases,
                       KvStream (publish own instances' KV events, index everyone's),
                       ClusterRouter + Forwarder (the request table's `cluster` hook),
                       the abort responder (subject kvsched.abort: aborts.py)
    admit_worker:      the WorkerService's Hello gate (worker_gate.py): own the instance
                       (lease by CAS) or answer a Redirect to its owner
    stop:              release this daemon's leases, mark its membership entry `leaving`

Failover (`takeover.py`, started by the daemon as `node.takeover`): a daemon whose membership
entry expired has its instances' leases moved by CAS and its unfinished requests adopted from
the journal. The dead daemon's workers find the new owner on their own: they try their next
daemon address, and a Hello for an instance leased to a live peer is redirected there (one
whose lessee is dead is taken by the daemon reached, with the same CAS).

While NATS is unreachable the node degrades: requests are routed among this daemon's own
instances, workers are admitted locally, and nothing accepted waits on NATS. With the journal,
once its membership could have expired it fences itself (`selffence.py`: no new work, its
requests parked for their clients to resume elsewhere). It heals when the connection comes
back (nats-py reconnects; the membership and the leases' watcher restart; the loops retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Protocol

from kvsched.cluster.aborts import ABORT_SUBJECT as ABORT_SUBJECT
from kvsched.cluster.aborts import AbortBus
from kvsched.cluster.cluster_view import cluster_status
from kvsched.cluster.fencing import hand_over_fenced
from kvsched.cluster.forward import Forwarder
from kvsched.cluster.kv_stream import KvStream
from kvsched.cluster.leases import Leases
from kvsched.cluster.membership import Membership
from kvsched.cluster.peer_rpc import FORWARD_INSTANCE, FORWARDED_BY, HAND_OVER, RELAYED, relay_owner
from kvsched.cluster.routing import ClusterRouter, RemoteInstance
from kvsched.cluster.selffence import SelfFence
from kvsched.cluster.worker_gate import WorkerGate
from kvsched.core import FinishReason, Request, Unavailable
from kvsched.server.auth import principal_of
from kvsched.server.instances.engine import InstanceEngine
from kvsched.v1 import admin_service_pb2 as apb

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping

    from kvsched.cluster.link import ClusterLink
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.instances.registry import InstanceRegistry
    from kvsched.server.requests.record import Tracked
    from kvsched.server.requests.table import RequestTable
    from kvsched.v1 import request_service_pb2 as rpb

log = logging.getLogger("kvsched.cluster")

NATS_TIMEOUT_S = 2.0
TAKEOVER_WAIT_S = 1.0  # a Resume waits this long at most for a takeover pass here to end


class _Stoppable(Protocol):
    async def stop(self) -> None: ...

    async def confirmed_dead(self, dead_id: str, address: str, instances: list[str]) -> None: ...

    async def settled(self, timeout_s: float) -> None: ...

    def busy(self, dead_id: str) -> bool: ...


class ClusterNode:
    def __init__(
        self,
        config: ServerConfig,
        link: ClusterLink,
        registry: InstanceRegistry,
        requests: RequestTable,
        address: str,
    ) -> None:
        self.config = config
        self.link = link
        self.daemon_id = link.daemon_id
        self.address = address
        self.registry = registry
        self.requests = requests
        self.membership = Membership(link, address, config.member_ttl_s, self._summary)
        self.leases = Leases(link)
        self.gate = WorkerGate(self)  # the Hello gate: own the instance or redirect its worker
        self.stream = KvStream(link, self._ready)
        self._addresses: dict[str, str] = {}
        self._owners: dict[str, str] = {}
        self.router = ClusterRouter(
            self.daemon_id, registry, self.stream.index, self._addresses, self._owners
        )
        self.stream.info_of = self._info_of
        self.stream.storage_index = registry.storage_index  # peers' storage writes (issue 25)
        registry.peer_models = self.router.peer_models
        registry.peer_limits = self.router.peer_limits
        registry.peer_ready_models = self.router.peer_ready_models
        self.forwarder = Forwarder(self.daemon_id, requests, config.cluster_token)
        self.forwarder.follow.peers = self._peer_addresses
        self.forwarder.stubs.silent = self.silent_at  # calls to a silent peer are given up
        self.forwarder.follow.reattach_s = max(20.0, 4 * config.member_ttl_s)
        self.forwarder.reroute = self._reroute
        token = config.cluster_token
        self._cluster_principal = principal_of(token) if config.auth_file and token else None
        if config.auth_file and not token:
            self._cluster_principal = "\0no cluster token"  # nobody may act as a peer
        self.aborts = AbortBus(link, requests)  # the kvsched.abort subject
        self.num_fenced = 0  # attached instances handed to a daemon that took their lease
        self.fence = SelfFence(self)  # stops this daemon before its membership can expire
        self._task: asyncio.Task[None] | None = None
        # takeover.Takeover, set by the daemon (it knows the journal); stopped with the node
        self.takeover: _Stoppable | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.membership.start()
        await self.leases.start()
        await self.stream.start()
        await self.aborts.start()
        await self.link.nc.flush()
        self._refresh_views()
        for iid, lease in self.leases.owners().items():
            if lease.owner != self.daemon_id:
                self.stream.sync(iid)  # a late joiner: snapshots of the instances already up
        self._task = asyncio.get_running_loop().create_task(self._views(), name="cluster-views")
        self.requests.cluster = self
        self.registry.worker_gate = self.admit_worker
        self.registry.fencing_epoch = self.leases.epoch

    async def stop(self) -> None:
        self.requests.cluster = None
        self.registry.worker_gate = None
        self.registry.fencing_epoch = None
        if self.takeover is not None:
            await self.takeover.stop()
        if self._task is not None:
            self._task.cancel()
        await self.aborts.stop()
        await self.stream.stop()
        for iid, lease in self.leases.owners().items():
            if lease.owner == self.daemon_id:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.leases.release(iid), NATS_TIMEOUT_S)
        await self.leases.stop()
        await self.membership.stop()
        await self.forwarder.close()

    @property
    def connected(self) -> bool:
        return bool(self.link.nc.is_connected)

    def _ready(self) -> dict[str, InstanceEngine]:
        """This daemon's instances whose workers are all connected (their engines' facts)."""
        return {iid: e for iid, e in self.registry.engines.items() if e.ready}

    def _summary(self) -> tuple[list[str], dict[str, dict[str, float]]]:
        ready = self._ready()
        return sorted(ready), {iid: e.published_load() for iid, e in ready.items()}

    def _peer_addresses(self) -> list[str]:
        return [a for d, a in sorted(self._addresses.items()) if d != self.daemon_id]

    def silent_at(self, address: str) -> bool:
        """Whether the peer daemon at `address` has missed its membership heartbeats: no
        refresh of its entry seen for the fence margin (3/4 of the TTL), by when that daemon,
        if it runs at all, has fenced itself (selffence.py): paused, hung or cut off. Nothing
        waits on it (peer_rpc.PeerStubs.read); a daemon's own stale view says no. A peer whose
        entry expired since (the check is made every 0.25 s, and the crossing may come late on
        a loaded host, after the expiry) is given up on too, until it writes an entry again."""
        membership = self.membership
        for did, m in membership.members.items():
            if m.address == address and did != self.daemon_id:
                return membership.silent_for(did) > self.fence.after_s
        return address in membership.expired.values()

    def _refresh_views(self) -> None:
        """The router reads these dicts: live daemons' addresses and instance owners."""
        members = self.membership.members
        self._addresses.clear()
        self._addresses.update({d: m.address for d, m in members.items()})
        self._owners.clear()
        self._owners.update({i: lease.owner for i, lease in self.leases.owners().items()})
        self.router.refresh()  # which peers' instances may take requests (off the route path)

    async def _views(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(0.2)
            ticks += 1
            if ticks % 10 == 0 and self.connected:
                try:  # the watcher may have missed changes made while NATS was away
                    await asyncio.wait_for(self.leases.reload(), NATS_TIMEOUT_S)
                    await self._claim_unleased()
                except Exception as exc:
                    log.debug("leases reload: %r", exc)
            self._refresh_views()
            self.hand_over_now()
            self.fence.tick()

    def hand_over_now(self) -> None:
        """Attached instances whose lease a live peer took: their workers go there (fencing.py)."""
        self.num_fenced += hand_over_fenced(
            self.registry.engines, self.leases, self.membership.members
        )

    async def _claim_unleased(self) -> None:
        """Instances attached here while NATS was away have no lease: take it now (a
        conflict, another daemon holding it meanwhile, is logged: both drive it until one
        worker reconnects)."""
        for iid in list(self._ready()):
            if self.leases.cached_owner(iid) == self.daemon_id:
                continue
            lease = await asyncio.wait_for(self.leases.acquire(iid), NATS_TIMEOUT_S)
            eng = self.registry.engines.get(iid)
            if lease.owner == self.daemon_id and eng is not None:
                eng.fencing_epoch = lease.revision  # fenced from now on (Tasks carry it)
            elif lease.owner != self.daemon_id:
                log.warning(
                    "instance %s is attached here but leased to daemon %s", iid, lease.owner
                )

    # ---- workers ------------------------------------------------------------------------------
    async def admit_worker(self, hello: Any) -> bytes | None:
        """The WorkerService's Hello gate (worker_gate.py): None attaches the worker here."""
        return await self.gate.admit(hello)

    # ---- requests -----------------------------------------------------------------------------
    def route_new(
        self, req: Request, carrier: dict[str, str], owner: str, model: str = ""
    ) -> tuple[InstanceEngine | RemoteInstance, str]:
        """Where a new request goes, and the owner it is tracked under."""
        if self.fence.fenced:  # peers may be taking its instances over: no new work here
            raise Unavailable(self.fence.reason())
        if FORWARDED_BY in carrier:  # a peer chose this daemon: place it here, never forward
            relayed = relay_owner(carrier, owner, self._cluster_principal)
            eng = self.registry.engines.get(carrier.get(FORWARD_INSTANCE, ""))
            if req.output_token_ids:  # a peer's prefill instance hands it off (P/D)
                if eng is None or not eng.is_decode or not eng.accepting:
                    eng = self.registry.route_decode(req, model or self.registry.model_for(""))
                self.registry.candidates(req, model or self.registry.model_for(""), [eng])
            elif eng is None or not eng.queueing or eng.is_decode:
                eng = self.registry.route(req, model)
            else:
                self.registry.candidates(req, model or self.registry.model_for(""), [eng])
            return eng, owner if relayed is None else relayed
        if not self.connected:  # degraded: local instances only
            try:
                return self.registry.route(req, model), owner
            except Unavailable as exc:
                raise Unavailable(self.unreachable_reason(str(exc))) from None
        if (grouped := self.registry.group_engine(req, model)) is not None:
            return grouped, owner  # a sample waits where its group's prompt is computed here
        return self.router.route(req, model), owner

    def _reroute(
        self, req: Request, model: str, exclude: frozenset[str]
    ) -> InstanceEngine | RemoteInstance:
        """Where a request a peer refused goes now (the forwarder's): `route_new`'s rule
        without the daemons in `exclude`."""
        if self.fence.fenced:
            raise Unavailable(self.fence.reason())
        if not self.connected:
            return self.registry.route(req, model)
        return self.router.route(req, model, exclude=exclude)

    def hand_over_from(self, carrier: dict[str, str], caller: str) -> str:
        """The peer handing this Resume's request over to this daemon (forward.py's
        `hand_over`; honoured from a peer holding the cluster token, or without auth), or
        "" when it is no hand-over."""
        giver = carrier.get(FORWARDED_BY, "")
        ok = (
            HAND_OVER in carrier
            and giver not in ("", self.daemon_id)
            and relay_owner(carrier, caller, self._cluster_principal) is not None
            and self.fence.enabled
            and not self.fence.fenced
        )
        return giver if ok else ""

    def hand_over_parked(self, tr: Tracked) -> bool:
        """A request parked here, still this daemon's: handed to a peer's instance when none
        here can take it (forward.py); True when that started."""
        return self.forwarder.hand_over(tr)

    def refuse_if_fenced(self) -> None:
        """Unavailable while this daemon is fenced (selffence.py): a Resume of a request it does
        not hold is not looked up in a journal it cannot reach; the client tries elsewhere."""
        if self.fence.fenced:
            raise Unavailable(self.fence.reason())

    def unreachable_reason(self, local: str) -> str:
        """Why a request cannot be placed while NATS is down: the cause first (the cluster is
        unreachable), then what this daemon has itself (`local`: the registry's reason)."""
        peers = sorted(
            {v.daemon for v in self.stream.index.instances.values() if v.daemon != self.daemon_id}
        )
        cause = self.link.last_error or "connection lost"
        reach = (
            f"its peers ({', '.join(peers)}) and their instances cannot be reached without it"
            if peers
            else "no peer can be reached without it"
        )
        return (
            f"the cluster is unreachable: NATS at {self.link.url} is down ({cause}); {reach}, "
            f"and this daemon has no instance of its own to run the request ({local}); retry "
            "later, or send it to another daemon"
        )

    def _info_of(self, iid: str) -> dict[str, Any] | None:
        """An instance's model and limits, published with its load (server/instances/models.py)."""
        eng = self.registry.engines.get(iid)
        lim = None if eng is None else eng.limits
        if eng is None or lim is None:
            return None
        info: dict[str, Any] = {
            "role": str(eng.role),  # a peer never routes a new request to a decode instance
            "model": lim.model,
            "max_model_len": lim.max_model_len,
            "vocab_size": lim.vocab_size,
            "multimodal": lim.multimodal,
            "structured_outputs": lim.structured_outputs,
        }
        if lim.loras:  # its adapters, and which of them run or wait there now (affinity)
            max_loras, active = eng.lora_slots()
            info.update(loras=[list(a) for a in lim.loras], max_loras=max_loras)
            info["active_loras"] = active
        return info

    def forward(
        self,
        tr: Tracked,
        msg: rpb.GenerateRequest,
        remote: RemoteInstance,
        carrier: dict[str, str],
        deadline_s: float | None,
    ) -> asyncio.Task[None]:
        """Relay `tr` from the peer's instance `remote`: the relay's task."""
        return self.forwarder.start(tr, msg, remote, carrier, deadline_s)

    def decode_peer(self, model: str, count: bool = True) -> RemoteInstance | None:
        """A peer's decode instance for a prefilled request (P/D across daemons), or None
        (degraded: no peer is reachable)."""
        if not self.connected or self.fence.fenced:
            return None
        return self.router.decode_peer(model or self.registry.model_for(""), count)

    async def forward_confirmed(self, tr: Tracked) -> None:
        """Wait until the peer `tr` was forwarded to accepted it (see Forwarder.confirmed)."""
        await self.forwarder.confirmed(tr)

    async def resume_at(
        self,
        daemon_id: str,
        msg: rpb.RequestServiceResumeRequest,
        owner: str,
        carrier: dict[str, str],
    ) -> AsyncIterator[rpb.RequestServiceResumeResponse]:
        """Relay a Resume to the live daemon that owns the request (its journal record names
        it); Unavailable while that daemon is dead and nobody has adopted its requests yet,
        or when this call is itself a relay (never relayed twice)."""
        member = None
        if carrier.get(FORWARDED_BY) == daemon_id:
            pass  # the owner's own forwarder, following it: the owner adopted it (it continues)
        elif daemon_id != self.daemon_id and RELAYED not in carrier and self.connected:
            member = await asyncio.wait_for(self.gate.live_member(daemon_id), NATS_TIMEOUT_S)
            silent = self.membership.silent_for(daemon_id)
            if member is not None and silent > self.fence.after_s:
                # Its entry stopped changing: paused or cut off, so fenced by now (a relay
                # would hang on it); its requests are adopted once the entry expires.
                raise Unavailable(
                    f"request {msg.request_id!r} belongs to daemon {daemon_id!r}, which has "
                    f"not refreshed its membership for {silent:.1f} s (paused or cut off); it "
                    f"is adopted when that entry expires ({self.config.member_ttl_s:g} s): retry"
                )
        if member is None:
            raise Unavailable(
                f"request {msg.request_id!r} belongs to daemon {daemon_id!r}, which is not "
                f"running; a live daemon adopts its requests within about "
                f"{1.5 * self.config.member_ttl_s:g} s (or it restarts): retry"
            )
        async for out in self.forwarder.resume(member.address, msg, owner):
            yield out

    async def takeovers_settled(self) -> None:
        """Wait (at most TAKEOVER_WAIT_S) until no takeover pass runs here: a request the
        journal names this daemon for, that its table does not hold yet, may be in the middle
        of being adopted here (its record is stored under this daemon before the CAS)."""
        if self.takeover is not None:
            await self.takeover.settled(TAKEOVER_WAIT_S)

    def adopting(self, daemon_id: str) -> bool:
        """Whether a takeover pass of `daemon_id` runs here now: a Resume of one of its
        requests waits for it (`takeovers_settled`) and is served from the table once adopted
        here, rather than refused as the dead daemon's."""
        return self.takeover is not None and self.takeover.busy(daemon_id)

    def forwarded_by(self, carrier: Mapping[str, str]) -> str:
        """The peer daemon that forwarded (or relayed) this call here, or "" for a client's."""
        return carrier.get(FORWARDED_BY, "")

    def from_peer(self, carrier: Mapping[str, str], caller: str) -> bool:
        """Whether the call came from a peer daemon: forwarded, and made with the cluster's
        token when auth is on (a client that sets the forward metadata is not a peer)."""
        return relay_owner(dict(carrier), caller, self._cluster_principal) is not None

    def caller_of(self, carrier: dict[str, str], caller: str) -> str:
        """The principal a call acts for: the original client's when a peer relayed it."""
        relayed = relay_owner(carrier, caller, self._cluster_principal)
        return caller if relayed is None else relayed

    async def abort_elsewhere(
        self, request_id: str, owner: str | None, reason: FinishReason = FinishReason.ABORT
    ) -> bool:
        """Ask every daemon to abort `request_id` (True: one of them tracked it), ending it
        with `reason` (ABORT, or STOP for its client's own stop condition)."""
        return await self.aborts.ask(request_id, owner, reason)

    # ---- status ---------------------------------------------------------------------------
    def cluster_status(self) -> apb.ClusterStatus:
        """The cluster as this daemon sees it (AdminService.GetStatus)."""
        return cluster_status(self)
