"""Forwarding: a request this daemon accepted runs on a peer's instance; its outputs are relayed.

The forwarding daemon keeps the request in its own request table (a `Tracked` whose location is
a `RemotePeer`: the peer's `RemoteInstance` and this relay's task) and calls the peer's
`RequestService.Generate` with the same request id and the metadata keys peer_rpc.py lists
(the wire: keys, channels, a Finished read back).

Tokens are appended to the local request as they arrive and handed to its sink; the peer's
Finished becomes the local request's one finished state (`RequestTable.finish`). The forwarder
is a lifecycle observer of the table: a relayed request that ends here first (aborted, its
client dropped) has its relay cancelled (`request_finished`), and the call with it: the peer
sees its client go and aborts. A peer that refuses the request before accepting it (no
instance ready there, its journal out of reach, its address refusing connections) has it
recorded in this daemon's journal and placed again by the cluster's routing without that peer:
another peer's instance or one here (`_choose_again`), never ended for it. A peer that fails
the stream later with UNAVAILABLE has the request followed to its new owner (`Follower.reattach`), or
parked in the local table (`requeue_lost`: recomputed here, keeping the tokens already
streamed) and journaled here. A peer that refuses the forward because it runs that very
request already (an earlier forward of it reached the peer and that call broke: the typed
`RequestAlreadyLive` refusal, peer_rpc.live_there) has it followed there by Resume from the
tokens relayed so far (`_follow_there`), so its client gets each token once and one Finished.
Only while its client still reads it here: a client that gave up on this daemon follows the
request itself (through the journal), and a Resume from here would take the stream from it,
so such a request is let go, running on at the peer (`Follower.client_gone`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvsched.cluster.follow import Follower
from kvsched.cluster.peer_rpc import (
    FORWARD_INSTANCE,
    FORWARD_OWNER,
    FORWARDED_BY,
    HAND_OVER,
    RELAYED,
    RETRYABLE,
    PeerStubs,
    ended,
    live_there,
)
from kvsched.cluster.routing import RemoteInstance
from kvsched.core import FinishReason, KvschedError
from kvsched.server.requests.record import Parked, RemotePeer
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from kvsched.core import Request
    from kvsched.server.instances.engine import InstanceEngine
    from kvsched.server.requests.durable import Durability
    from kvsched.server.requests.record import Tracked
    from kvsched.server.requests.table import RequestTable

log = logging.getLogger("kvsched.cluster")

HAND_OVER_AFTER_S = 2.0  # a request parked this long with no instance here is handed over


class Forwarder:
    def __init__(self, daemon_id: str, requests: RequestTable, token: str = "") -> None:
        self.daemon_id = daemon_id
        self.requests = requests
        self.token = token
        self.stubs = PeerStubs(token)  # peer_rpc.py: channels to peers, the cluster token
        # Following a relayed request: its outputs, its peer's death, a Resume taking it over.
        self.follow = Follower(daemon_id, requests, self.stubs)
        self.num_requeued = 0
        # A request a peer refused is placed again through this (the cluster node's routing,
        # the refusing daemons excluded; None: not at all) and recorded in this daemon's
        # journal meanwhile (`durable`, set by the daemon when it journals).
        self.reroute: (
            Callable[[Request, str, frozenset[str]], InstanceEngine | RemoteInstance] | None
        ) = None
        self.durable: Durability | None = None  # `use_journal`
        self.num_rerouted = 0
        self.num_handed_over = 0
        # Relays whose peer has not accepted the request yet (by request id): the Generate
        # that forwarded it waits on this before its client is told `queued` (`confirmed`).
        self._unconfirmed: dict[str, asyncio.Future[None]] = {}
        self._stops: set[asyncio.Task[None]] = set()  # STOP aborts on their way to peers

    def use_journal(self, durable: Durability) -> None:
        """Record requests in this daemon's journal (refused by a peer, or parked here)."""
        self.durable = durable
        self.follow.durable = durable

    def start(
        self,
        tr: Tracked,
        msg: rpb.GenerateRequest,
        remote: RemoteInstance,
        carrier: dict[str, str],
        deadline_s: float | None,
    ) -> asyncio.Task[None]:
        """Start relaying `tr` from `remote`; returns the relay's task (the table keeps it in
        the record's location, `RequestTable.relay_started`)."""
        fwd = rpb.GenerateRequest()
        fwd.CopyFrom(msg)
        fwd.request_id = tr.req.req_id
        md = [
            (FORWARDED_BY, self.daemon_id),
            (FORWARD_INSTANCE, remote.instance_id),
            (FORWARD_OWNER, tr.owner),
        ]
        md += [(k, v) for k, v in carrier.items() if k in ("traceparent", "tracestate")]
        md += self.stubs.auth()
        loop = asyncio.get_running_loop()
        self._unconfirmed[tr.req.req_id] = loop.create_future()
        task = loop.create_task(
            self._relay(tr, fwd, remote, md, deadline_s), name=f"forward-{tr.req.req_id}"
        )
        task.add_done_callback(lambda _: self._confirm(tr))  # however it ends (cancelled too)
        return task

    async def confirmed(self, tr: Tracked) -> None:
        """Wait until the peer `tr` was forwarded to has accepted it (its first answer, sent
        once its journal stored it), it is recorded in this daemon's journal (a refusal
        brought it back), or its relay has ended (it finished or was aborted here)."""
        fut = self._unconfirmed.get(tr.req.req_id)
        if fut is not None:
            await asyncio.shield(fut)

    def _confirm(self, tr: Tracked) -> None:
        fut = self._unconfirmed.pop(tr.req.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _relay(
        self,
        tr: Tracked,
        msg: rpb.GenerateRequest,
        remote: RemoteInstance,
        md: list[tuple[str, str]],
        deadline_s: float | None,
    ) -> None:
        req = tr.req
        refused: set[str] = set()  # daemons that refused it (chosen again without them)
        while True:
            accepted = False  # the peer answered: it took (and journaled) the request
            call = self.stubs.stub(remote.address).Generate(msg, metadata=md, timeout=deadline_s)
            try:
                async for out in self.stubs.read(call, remote.address):
                    if not accepted:
                        accepted = True
                        self._confirm(tr)  # that peer journals it: its client may be told
                        if self.durable is not None:  # recorded here meanwhile: that peer's now
                            self.durable.moved_to(tr, remote.daemon_id)
                    if self.follow.take(tr, out):
                        return
                if accepted:  # OK, no Finished: a Resume took its stream over (see below)
                    self.follow.streamed_elsewhere(tr, remote.daemon_id)
                    return
                raise ended()
            except grpc.aio.AioRpcError as exc:
                if tr.finished:
                    return
                why = f"forwarded to daemon {remote.daemon_id}: {exc.code().name}: {exc.details()}"
                if not accepted and live_there(exc):
                    # An earlier forward of it reached that daemon (and its call broke), or
                    # its client, tired of waiting here, had it accepted there directly.
                    if self.follow.client_gone(tr):
                        self.follow.streamed_elsewhere(tr, remote.daemon_id, "its client left")
                    else:
                        await self._follow_there(tr, msg, remote, why)
                    return
                retryable = exc.code() in RETRYABLE
                if retryable and not accepted and not req.output_token_ids:
                    # Refused before it was accepted there (no instance ready, its journal cut
                    # off): choose again, without that daemon, instead of ending it.
                    refused.add(remote.daemon_id)
                    nxt = await self._choose_again(tr, msg, why, refused)
                    if nxt is None:
                        return  # runs here now, or parked here
                    remote = nxt
                    md = [(k, v) if k != FORWARD_INSTANCE else (k, nxt.instance_id) for k, v in md]
                    continue
                if retryable and await self.follow.reattach(tr, why):
                    return
                if tr.finished:
                    return
                self.requests.relay_ended(tr)
                if retryable:
                    self.num_requeued += 1
                    log.warning("%s; recomputing request %s here", why, req.req_id)
                    self.requests.requeue_lost(req, why)
                    await self._record_here(tr, msg)  # never parked here unjournaled
                else:
                    self.requests.abort_tracked(tr, why)
                return
            finally:
                call.cancel()

    async def _follow_there(
        self, tr: Tracked, msg: rpb.GenerateRequest, remote: RemoteInstance, why: str
    ) -> None:
        """`remote`'s daemon runs `tr` already (peer_rpc.live_there): followed there by Resume
        past the tokens relayed so far (`Follower.reattach`, asking that daemon first); recomputed
        here when nobody holds it any more."""
        rid = tr.req.req_id
        self._confirm(tr)  # that daemon journals it: its client may be told
        log.info(
            "request %s is live at daemon %s already: following it there", rid, remote.daemon_id
        )
        if await self.follow.reattach(tr, why, first=remote) or tr.finished:
            return
        self.requests.relay_ended(tr)
        self.num_requeued += 1
        log.warning("%s; recomputing request %s here", why, rid)
        self.requests.requeue_lost(tr.req, why)
        await self._record_here(tr, msg)  # never parked here unjournaled

    async def _choose_again(
        self, tr: Tracked, msg: rpb.GenerateRequest, why: str, refused: set[str]
    ) -> RemoteInstance | None:
        """`tr` was refused by the peer it was forwarded to, before any output: it is recorded
        in this daemon's journal first (this daemon may die while it waits), then placed by
        the cluster's routing again, the refusing daemons left out: another peer's instance
        (returned: relay it from there), or an instance here (None: it runs here). While
        nothing can take it, tried again every 0.5 s (the refusing peers too, once all
        refused) for requeue_timeout_s; then parked here like a lost instance's request."""
        rid = tr.req.req_id
        log.warning("%s; choosing again for request %s", why, rid)
        await self._record_here(tr, msg)
        give_up = time.monotonic() + self.requests.config.requeue_timeout_s
        task = asyncio.current_task()
        last = ""  # why nothing took it on the last try
        while not tr.finished:
            target: InstanceEngine | RemoteInstance | None = None
            if self.reroute is not None:
                try:
                    target = self.reroute(tr.req, tr.model, frozenset(refused))
                except KvschedError as exc:
                    last = str(exc)
            if isinstance(target, RemoteInstance):
                if task is not None:
                    self.requests.relay_started(tr, task, target)
                self.num_rerouted += 1
                log.info("request %s forwarded again, to daemon %s", rid, target.daemon_id)
                return target
            if target is not None:
                try:
                    self.requests.place_here(tr, target)
                except KvschedError as exc:
                    last = str(exc)
                else:
                    self.num_rerouted += 1
                    log.info("request %s placed here, on %s", rid, target.instance_id)
                    await self._record_here(tr, msg)
                    return None
            if time.monotonic() >= give_up:
                break
            refused.clear()  # nothing took it: the refusing peers may be ready again
            await asyncio.sleep(0.5)
        if not tr.finished:
            self.requests.relay_ended(tr)
            self.num_requeued += 1
            self.requests.requeue_lost(tr.req, f"{why}; then: {last}" if last else why)
        return None

    async def _record_here(self, tr: Tracked, msg: rpb.GenerateRequest) -> None:
        durable = self.durable
        if durable is not None and not tr.finished and await durable.record_here(tr, msg):
            log.info("request %s recorded in this daemon's journal", tr.req.req_id)
            self._confirm(tr)  # journaled here: its client may be told

    def hand_over(self, tr: Tracked) -> bool:
        """`tr` is parked here, journaled and still this daemon's, and no instance here can
        take it (they were all lost: their leases taken while this daemon was paused or cut
        off): hand it to the peer's instance the cluster's routing chooses. A Resume with
        HAND_OVER asks that peer to adopt it from the journal (its compare-and-set) and stream
        its outputs past the tokens it has; they are relayed here to its client. True when
        the hand-over started (its task is the record's relay)."""
        loc = tr.location
        if self.reroute is None or self.durable is None or type(loc) is not Parked:
            return False
        if self.requests.registry.route_moved(tr.req, tr.model) is not None:
            return False  # an instance here takes it: the table places it
        waited = self.requests.config.requeue_timeout_s - (loc.deadline - time.monotonic())
        if waited < HAND_OVER_AFTER_S:
            return False  # just parked: its instance's workers may be reconnecting here
        try:
            target = self.reroute(tr.req, tr.model, frozenset())
        except KvschedError:
            return False
        if not isinstance(target, RemoteInstance):
            return False  # an instance here takes it: the table places it
        task = asyncio.get_running_loop().create_task(
            self._hand_over(tr, target, loc), name=f"hand-over-{tr.req.req_id}"
        )
        self.requests.hand_to_peer(tr, target, task)
        return True

    async def _hand_over(self, tr: Tracked, remote: RemoteInstance, parked: Parked) -> None:
        req = tr.req
        msg = rpb.RequestServiceResumeRequest(request_id=req.req_id, token_ids=req.output_token_ids)
        md = [(FORWARDED_BY, self.daemon_id), (FORWARD_OWNER, tr.owner), (HAND_OVER, "1")]
        call = self.stubs.stub(remote.address).Resume(msg, metadata=md + self.stubs.auth())
        taken = False
        try:
            async for out in self.stubs.read(call, remote.address):
                if not taken:  # adopted there: its journal record names that daemon now
                    taken = True
                    self.num_handed_over += 1
                    if self.durable is not None and self.durable.journal is not None:
                        self.durable.journal.adopted_elsewhere(tr)
                    log.info("request %s handed over to daemon %s", req.req_id, remote.daemon_id)
                if self.follow.take(tr, out):
                    return
            if taken:  # OK, no Finished: a Resume there took its stream over
                self.follow.streamed_elsewhere(tr, remote.daemon_id)
                return
            raise ended()
        except grpc.aio.AioRpcError as exc:
            if tr.finished:
                return
            why = f"handed over to daemon {remote.daemon_id}: {exc.code().name}: {exc.details()}"
            self.requests.relay_ended(tr)
            if not taken:
                log.info("%s; request %s waits here", why, req.req_id)
                self.requests.park_again(tr, parked)  # still this daemon's
                return
            if exc.code() in RETRYABLE and await self.follow.reattach(tr, why):
                return
            if not tr.finished:
                self.requests.requeue_lost(req, why)
        finally:
            call.cancel()

    # ---- Lifecycle (an observer of the request table) ---------------------------------------
    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        pass

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        pass

    def request_progressed(self, tr: Tracked, /) -> None:
        pass

    def request_finished(self, tr: Tracked, /) -> None:
        """Ended here first (aborted, dropped, failed): the peer aborts it too (the call's
        cancellation tells it)."""
        loc = tr.location
        if type(loc) is RemotePeer and loc.relay is not None:
            if tr.req.finish_reason == FinishReason.STOP:  # its client's own stop (a stop string)
                self._stop_there(tr, loc.instance.address, loc.relay)
            else:
                loc.relay.cancel()

    def _stop_there(self, tr: Tracked, address: str, relay: asyncio.Task[None]) -> None:
        """End a relayed request at its peer as stopped (Abort with reason STOP, as its client
        asked here), not as an abort (what the relay's cancellation alone would say); the
        relay ends once the peer has been told (or could not be, within 5 s)."""
        md = [(FORWARDED_BY, self.daemon_id), (FORWARD_OWNER, tr.owner), *self.stubs.auth()]
        msg = rpb.AbortRequest(request_id=tr.req.req_id, reason=common_pb2.FINISH_REASON_STOP)

        async def stop() -> None:
            try:
                await self.stubs.stub(address).Abort(msg, metadata=md, timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                log.info("stop of %s at %s: %s", tr.req.req_id, address, exc.code().name)
            finally:
                relay.cancel()

        task = asyncio.get_running_loop().create_task(stop(), name=f"stop-{tr.req.req_id}")
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    async def resume(
        self, address: str, msg: rpb.RequestServiceResumeRequest, owner: str
    ) -> AsyncIterator[rpb.RequestServiceResumeResponse]:
        """A client's Resume relayed to the daemon at `address` (the request's owner), as the
        client's principal (`x-kvsched-owner`, honoured from a cluster-token caller). Its
        errors reach the caller as `grpc.aio.AioRpcError`."""
        md = [(FORWARDED_BY, self.daemon_id), (FORWARD_OWNER, owner), (RELAYED, "1")]
        call = self.stubs.stub(address).Resume(msg, metadata=md + self.stubs.auth())
        try:
            async for out in self.stubs.read(call, address):
                yield out
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.stubs.close()
