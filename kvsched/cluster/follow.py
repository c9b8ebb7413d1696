"""Following a relayed request (the forwarder's part that reads a peer's stream).

`Follower.take` puts one output of a peer's stream (a forwarded Generate, a hand-over, a
Resume) into the local request and its sink; the peer's Finished becomes the request's one
finished state. When the peer goes away, `reattach` follows the request to wherever its
journal says it lives now, with a Resume through any live peer carrying the tokens relayed so
far. A request whose stream a Resume elsewhere took over, or whose client left this daemon
(`client_gone`), leaves this daemon unfinished (`streamed_elsewhere`): it runs on at the peer
and its client follows it there through the journal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvsched.cluster.peer_rpc import (
    FORWARD_OWNER,
    FORWARDED_BY,
    RETRYABLE,
    PeerStubs,
    apply_finished,
)
from kvsched.core import lifecycle
from kvsched.core.protocol import FinishReason
from kvsched.core.slots import extend_output
from kvsched.server.requests.resume import ParkedSink
from kvsched.v1 import request_service_pb2 as rpb

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvsched.cluster.routing import RemoteInstance
    from kvsched.server.requests.durable import Durability
    from kvsched.server.requests.record import Tracked
    from kvsched.server.requests.table import RequestTable

log = logging.getLogger("kvsched.cluster")


class Follower:
    def __init__(self, daemon_id: str, requests: RequestTable, stubs: PeerStubs) -> None:
        self.daemon_id = daemon_id
        self.requests = requests
        self.stubs = stubs  # the forwarder's channels to peers
        self.durable: Durability | None = None  # set with the forwarder's (`use_journal`)
        # Live peers' addresses (set by the cluster node): where a request whose peer died is
        # followed to its new owner, for up to `reattach_s` (None: recompute it here at once).
        self.peers: Callable[[], list[str]] | None = None
        self.reattach_s = 20.0
        self.num_relayed_tokens = 0
        self.num_reattached = 0
        self.num_streamed_elsewhere = 0  # requests let go: run on at a peer

    def take(
        self, tr: Tracked, out: rpb.GenerateResponse | rpb.RequestServiceResumeResponse
    ) -> bool:
        """One output of the peer's stream into the local request; True at its Finished (or
        once it ended here: a stopped request's relay reads on until its peer is told)."""
        req = tr.req
        if tr.finished:
            # Stopped here (a stop string): its peer is being told by an Abort with reason STOP
            # (ForwardRelay._stop_there, which ends this relay once that is done). Ending the
            # call now would reach the peer's engine as an abort, racing the STOP.
            return req.finish_reason != FinishReason.STOP or out.WhichOneof("kind") == "finished"
        kind = out.WhichOneof("kind")
        if kind == "tokens":
            toks = list(out.tokens.token_ids)
            if toks:
                if req.first_token_time < 0:
                    lifecycle.relayed(req, time.monotonic(), tokens=True)
                extend_output(req, toks)
                self.num_relayed_tokens += len(toks)
                tr.sink.add_tokens([tr], [len(toks)], toks)
        elif kind == "finished":
            self.finish(tr, out.finished)
            return True
        elif kind == "queued" and req.first_scheduled_time < 0:
            lifecycle.relayed(req, time.monotonic(), tokens=False)
        return False

    async def reattach(self, tr: Tracked, why: str, first: RemoteInstance | None = None) -> bool:
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
            if self.client_gone(tr):
                self.streamed_elsewhere(tr, first.daemon_id if first else "", "its client left")
                return True
            # Peers that missed their heartbeats would fail at once (PeerStubs.read): skipped.
            peers = [] if self.peers is None else self.peers()
            peers = [a for a in peers if not self.stubs.silent(a)]
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
                    async for out in self.stubs.read(call, address):
                        answered = True
                        if holder and self.durable is not None:
                            self.durable.moved_to(tr, holder)  # that daemon journals it
                            holder = ""
                        if self.take(tr, out):
                            self.num_reattached += 1
                            return True
                    if answered:  # OK, no Finished: another Resume took its stream over
                        self.streamed_elsewhere(tr, "")
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

    def client_gone(self, tr: Tracked) -> bool:
        """`tr`'s client no longer reads its stream here (it gave up waiting for this daemon
        and resumed, or submitted again, elsewhere; or it went away) and the cluster's journal
        will lead it to the request wherever it runs. Such a request is not followed by a
        Resume from here: that Resume would take the stream from the client, reading it at
        the owner by then (the 30-minute nemesis run lost 12 requests so, in partitions
        between daemons). Without a journal it is followed: only this daemon can serve it."""
        durable = self.durable
        return durable is not None and durable.journal is not None and not tr.sink.attached()

    def streamed_elsewhere(
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

    def finish(self, tr: Tracked, fin: rpb.Finished) -> None:
        apply_finished(tr.req, fin, time.monotonic())
        self.requests.relay_ended(tr)
        self.requests.finish(tr)
