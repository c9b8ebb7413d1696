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
the stream later with UNAVAILABLE has the request followed to its new owner (`_reattach`), or
parked in the local table (`requeue_lost`: recomputed here, keeping the tokens already
streamed) and journaled here. A peer that refuses the forward because it runs that very
request already (an earlier forward of it reached the peer and that call broke: the typed
`RequestAlreadyLive` refusal, peer_rpc.live_there) has it followed there by Resume from the
tokens relayed so far (`_follow_there`), so its client gets each token once and one Finished.
Only while its client still reads it here: a client that gave up on this daemon follows the
request itself (through the journal), and a Resume from here would take the stream from it,
so such a request is let go, running on at the peer (`_client_gone`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvsched.cluster.peer_rpc import (
    FORWARD_INSTANCE,
    FORWARD_OWNER,
    FORWARDED_BY,
    HAND_OVER,
    RELAYED,
    RETRYABLE,
    PeerStubs,
    apply_finished,
    ended,
    live_there,
)
from kvsched.cluster.routing import RemoteInstance
from kvsched.core import KvschedError
from kvsched.server.record import Parked, RemotePeer
from kvsched.server.resume import ParkedSink
from kvsched.v1 import request_service_pb2 as rpb

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from kvsched.core import Request
    from kvsched.server.durable import Durability
    from kvsched.server.engine import InstanceEngine
    from kvsched.server.record import Tracked
    from kvsched.server.request_table import RequestTable

log = logging.getLogger("kvsched.cluster")

HAND_OVER_AFTER_S = 2.0  # a request parked this long with no instance here is handed over


class Forwarder:
    def __init__(self, daemon_id: str, requests: RequestTable, token: str = "") -> None:
        self.daemon_id = daemon_id
        self.requests = requests
        self.token = token
        self.stubs = PeerStubs(token)  # peer_rpc.py: channels to peers, the cluster token
        self.num_relayed_tokens = 0
        self.num_requeued = 0
        self.num_reattached = 0
        self.num_streamed_elsewhere = 0  # relays ended by a Resume that took the stream over
        # Live peers' addresses (set by the cluster node): where a request whose peer died is
        # followed to its new owner, for up to `reattach_s` (None: recompute it here at once).
        self.peers: Callable[[], list[str]] | None = None
        self.reattach_s = 20.0
        # A request a peer refused is placed again through this (the cluster node's routing,
        # the refusing daemons excluded; None: not at all) and recorded in this daemon's
        # journal meanwhile (`durable`, set by the daemon when it journals).
        self.reroute: (
            Callable[[Request, str, frozenset[str]], InstanceEngine | RemoteInstance] | None
        ) = None
        self.durable: Durability | None = None
        self.num_rerouted = 0
        self.num_handed_over = 0
        # Relays whose peer has not accepted the request yet (by request id): the Generate
        # that forwarded it waits on this before its client is told `queued` (`confirmed`).
        self._unconfirmed: dict[str, asyncio.Future[None]] = {}

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
                async for out in call:
                    if not accepted:
                        accepted = True
                        self._confirm(tr)  # that peer journals it: its client may be told
                        if self.durable is not None:  # recorded here meanwhile: that peer's now
                            self.durable.moved_to(tr, remote.daemon_id)
                    if self._take(tr, out):
                        return
                if accepted:  # OK, no Finished: a Resume took its stream over (see below)
                    self._streamed_elsewhere(tr, remote.daemon_id)
                    return
                raise ended()
            except grpc.aio.AioRpcError as exc:
                if tr.finished:
                    return
                why = f"forwarded to daemon {remote.daemon_id}: {exc.code().name}: {exc.details()}"
                if not accepted and live_there(exc):
                    # An earlier forward of it reached that daemon (and its call broke), or
                    # its client, tired of waiting here, had it accepted there directly.
                    if self._client_gone(tr):
                        self._streamed_elsewhere(tr, remote.daemon_id, "its client left")
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
                if retryable and await self._reattach(tr, why):
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
        past the tokens relayed so far (`_reattach`, asking that daemon first); recomputed
        here when nobody holds it any more."""
        rid = tr.req.req_id
        self._confirm(tr)  # that daemon journals it: its client may be told
        log.info(
            "request %s is live at daemon %s already: following it there", rid, remote.daemon_id
        )
        if await self._reattach(tr, why, first=remote) or tr.finished:
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
            async for out in call:
                if not taken:  # adopted there: its journal record names that daemon now
                    taken = True
                    self.num_handed_over += 1
                    if self.durable is not None and self.durable.journal is not None:
                        self.durable.journal.adopted_elsewhere(tr)
                    log.info("request %s handed over to daemon %s", req.req_id, remote.daemon_id)
                if self._take(tr, out):
                    return
            if taken:  # OK, no Finished: a Resume there took its stream over
                self._streamed_elsewhere(tr, remote.daemon_id)
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
            if exc.code() in RETRYABLE and await self._reattach(tr, why):
                return
            if not tr.finished:
                self.requests.requeue_lost(req, why)
        finally:
            call.cancel()

    def _take(
        self, tr: Tracked, out: rpb.GenerateResponse | rpb.RequestServiceResumeResponse
    ) -> bool:
        """One output of the peer's stream into the local request; True at its Finished."""
        req = tr.req
        kind = out.WhichOneof("kind")
        if kind == "tokens":
            toks = list(out.tokens.token_ids)
            if toks:
                if req.first_token_time < 0:
                    req.first_token_time = time.monotonic()
                req.output_token_ids.extend(toks)
                self.num_relayed_tokens += len(toks)
                tr.sink.add_tokens([tr], [len(toks)], toks)
        elif kind == "finished":
            self._finish(tr, out.finished)
            return True
        elif kind == "queued" and req.first_scheduled_time < 0:
            req.first_scheduled_time = time.monotonic()
        return False

    async def _reattach(self, tr: Tracked, why: str, first: RemoteInstance | None = None) -> bool:
        """The peer running `tr` went away: follow the request to wherever its journal says it
        lives now (its daemon restarted, or a peer adopted it) with a Resume through any live
        peer (which relays it to the owner), carrying the tokens already relayed; `first`: the
        daemon known to hold it, asked first (its record here, if any, then names that daemon
        once it streams: `Durability.moved_to`). True when the request ended that way
        (finished or aborted); False: not journaled anywhere (or nobody took it within
        `reattach_s`), the caller recomputes it here."""
        if self.peers is None and first is None:
            return False
        req = tr.req
        give_up = time.monotonic() + self.reattach_s
        if first is None:
            log.info("%s; following request %s to its new owner", why, req.req_id)
        tries = 0
        while time.monotonic() < give_up and not tr.finished:
            if self._client_gone(tr):
                self._streamed_elsewhere(tr, first.daemon_id if first else "", "its client left")
                return True
            peers = [] if self.peers is None else self.peers()
            if first is not None and tries == 0:
                peers = [first.address]
            if peers:
                address = peers[tries % len(peers)]
                tries += 1
                msg = rpb.RequestServiceResumeRequest(
                    request_id=req.req_id, token_ids=req.output_token_ids
                )
                md = [(FORWARDED_BY, self.daemon_id), (FORWARD_OWNER, tr.owner), *self.stubs.auth()]
                call = self.stubs.stub(address).Resume(msg, metadata=md)
                holder = first.daemon_id if first is not None and tries == 1 else ""
                answered = False
                try:
                    async for out in call:
                        answered = True
                        if holder and self.durable is not None:
                            self.durable.moved_to(tr, holder)  # that daemon journals it
                            holder = ""
                        if self._take(tr, out):
                            self.num_reattached += 1
                            return True
                    if answered:  # OK, no Finished: another Resume took its stream over
                        self._streamed_elsewhere(tr, "")
                        return True
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        return False  # its owner never journaled it: recompute here
                    if exc.code() not in RETRYABLE:
                        self.requests.relay_ended(tr)
                        self.requests.abort_tracked(tr, f"{why}; resuming: {exc.details()}")
                        return True
                finally:
                    call.cancel()
            await asyncio.sleep(0.2)
        return tr.finished

    def _client_gone(self, tr: Tracked) -> bool:
        """`tr`'s client no longer reads its stream here (it gave up waiting for this daemon
        and resumed, or submitted again, elsewhere; or it went away) and the cluster's journal
        will lead it to the request wherever it runs. Such a request is not followed by a
        Resume from here: that Resume would take the stream from the client, reading it at
        the owner by then (the 30-minute nemesis run lost 12 requests so, in partitions
        between daemons). Without a journal it is followed: only this daemon can serve it."""
        durable = self.durable
        return durable is not None and durable.journal is not None and not tr.sink.attached()

    def _streamed_elsewhere(
        self, tr: Tracked, daemon_id: str, why: str = "a Resume there took its stream over"
    ) -> None:
        """The request leaves this daemon, unfinished: it runs on at the peer, its client
        following it there. So when the peer ended the relay's stream with OK and no
        Finished (a Resume took the request's stream over there, RequestService.Resume,
        step 3: the client whose call broke here, resuming straight at the peer), and when
        its client left (`_client_gone`). The relay stops; its stream here ends the same way.
        Following it again, as after a peer's death, would take the stream back from that
        client, which would take it back in turn, until one of the two gave up (the 30-minute
        nemesis run lost a request that way)."""
        if daemon_id and self.durable is not None:
            self.durable.moved_to(tr, daemon_id)  # recorded here meanwhile: that peer's now
        self.num_streamed_elsewhere += 1
        where = f"daemon {daemon_id}" if daemon_id else "a peer"
        log.info(
            "request %s runs on at %s (%s); not relayed here any more", tr.req.req_id, where, why
        )
        self.requests.streamed_elsewhere(tr, ParkedSink())

    def _finish(self, tr: Tracked, fin: rpb.Finished) -> None:
        apply_finished(tr.req, fin, time.monotonic())
        self.requests.relay_ended(tr)
        self.requests.finish(tr)

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
            loc.relay.cancel()

    async def resume(
        self, address: str, msg: rpb.RequestServiceResumeRequest, owner: str
    ) -> AsyncIterator[rpb.RequestServiceResumeResponse]:
        """A client's Resume relayed to the daemon at `address` (the request's owner), as the
        client's principal (`x-kvsched-owner`, honoured from a cluster-token caller). Its
        errors reach the caller as `grpc.aio.AioRpcError`."""
        md = [(FORWARDED_BY, self.daemon_id), (FORWARD_OWNER, owner), (RELAYED, "1")]
        call = self.stubs.stub(address).Resume(msg, metadata=md + self.stubs.auth())
        try:
            async for out in call:
                yield out
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.stubs.close()
