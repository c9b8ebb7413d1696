"""The request table: every request the daemon tracks, from acceptance to its one Finished.

It owns each request's record (`Tracked`, server/requests/record.py, stored in `Request.tag`): where it
is (a local engine, a peer's instance with its relay, or parked), its sink, its P/D decode
reservation, whether it has finished; and what ends requests from outside an engine: aborts,
queue timeouts and deadlines, streams that stopped reading, requests of lost instances waiting
for another one (parked). Every accepted request ends in exactly one `Finished`, decided by
`finish()`: the engines report through `EngineListener`, parked requests that run out of time
and a cluster's forwarder (a peer's Finished) all end there. Its observers (`Lifecycle`:
telemetry, the journal glue, the forwarder) are told of accepted, moved, progressed and
finished requests. Requests come in through server/requests/accept.py and back through
server/requests/resume.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvsched.core import (
    FinishReason,
    KvschedError,
    Request,
    RequestNotFound,
    Role,
    Unavailable,
    lifecycle,
)
from kvsched.server.cluster_port import ClusterPort
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.requests.observers import Observers
from kvsched.server.requests.poison import PoisonGuard
from kvsched.server.requests.record import (
    LocalEngine,
    Parked,
    PeerInstance,
    RemotePeer,
    Sink,
    Tracked,
    fresh_copy,
)
from kvsched.server.requests.watchdog import Watchdog

if TYPE_CHECKING:
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.instances.registry import InstanceRegistry
    from kvsched.server.telemetry.hooks import Telemetry

__all__ = ["RECENT_FINISHED", "ClusterPort", "RequestTable", "Sink", "Tracked"]

log = logging.getLogger("kvsched.daemon")

RECENT_FINISHED = 10_000  # ids remembered so a late Abort of a finished request is a no-op


class RequestTable:
    def __init__(
        self, config: ServerConfig, registry: InstanceRegistry, telemetry: Telemetry
    ) -> None:
        self.config = config
        self.registry = registry
        self.telemetry = telemetry
        self.tracked: dict[str, Tracked] = {}
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.draining = False  # shutting down: no new requests
        self.all_done = asyncio.Event()
        self.parked: list[Tracked] = []  # waiting for an instance (location: Parked)
        # Timers, open streams (cut when stalled), stood-still (watchdog.py; app.py ticks it)
        self.watchdog = Watchdog(config)
        self.streams = self.watchdog.streams  # open Generate / Session sinks (the same set)
        self.num_requeued = 0
        self.poison = PoisonGuard(config.poison_max_losses)
        # Told of every request's accepted / moved / progressed / finished, in this order:
        # telemetry; the journal glue and a cluster's forwarder subscribe (`observers.observe`).
        self.observers = Observers(telemetry)
        # A cluster's routing and forwarding (kvsched.cluster.node.ClusterNode, set by it;
        # None: alone): server/requests/accept.py, frontend.py and admin.py call it through this port.
        self.cluster: ClusterPort | None = None

    # ---- entering the table (server/requests/accept.py, server/requests/resume.py) ----------------------------
    def track(
        self,
        tr: Tracked,
        carrier: Mapping[str, str],
        deadline_s: float | None,
        queue_timeout: bool,
    ) -> None:
        """Start tracking an accepted request (already queued on its engine, or about to be
        forwarded): its timers, then the observers' `request_accepted`."""
        tr.req.tag = tr
        self.tracked[tr.req.req_id] = tr
        self.all_done.clear()
        self.watchdog.start(tr, deadline_s, queue_timeout)
        self.observers.request_accepted(tr, carrier)

    def track_parked(self, tr: Tracked) -> None:
        """Track a request recovered from the journal (location `Parked`): placed when an
        instance can take it; one that had produced all its tokens finishes at once."""
        req = tr.req
        req.tag = tr
        self.tracked[req.req_id] = tr
        self.all_done.clear()
        if len(req.output_token_ids) >= req.sampling.max_tokens:
            self.finish(tr, FinishReason.LENGTH, "")  # it had finished: its record was lost
            return
        self.parked.append(tr)

    def relay_started(
        self, tr: Tracked, relay: asyncio.Task[None], instance: PeerInstance | None = None
    ) -> None:
        """`tr` runs on a peer's instance (`instance`: another one than its location names,
        chosen again after a peer refused it); `relay` relays its outputs (the forwarder's)."""
        loc = tr.location
        if type(loc) is RemotePeer:
            tr.location = RemotePeer(instance or loc.instance, relay)

    def hand_to_peer(self, tr: Tracked, instance: PeerInstance, relay: asyncio.Task[None]) -> None:
        """A parked request (still this daemon's) goes to a peer's `instance`, which adopts
        it; `relay` relays its outputs from there (`Forwarder.hand_over`)."""
        tr.location = RemotePeer(instance, relay)

    def park_again(self, tr: Tracked, loc: Parked) -> None:
        """A request whose hand-over to a peer failed before the peer took it: parked here
        again, as it was (`loc`)."""
        if self.tracked.get(tr.req.req_id) is tr and not tr.finished:
            tr.location = loc
            self.parked.append(tr)

    def place_here(self, tr: Tracked, eng: InstanceEngine) -> None:
        """A request relayed to a peer that refused it before accepting it (no instance ready
        there, its journal out of reach) runs on this daemon's `eng` after all: queued there
        and tracked as `LocalEngine`. KvschedError (nothing changed): `eng` cannot take it."""
        loc = tr.location
        if type(loc) is not RemotePeer or tr.finished:
            raise Unavailable(f"request {tr.req.req_id!r} is no longer relayed to a peer")
        if eng.role != Role.MIXED:
            raise Unavailable(f"instance {eng.instance_id} is not a mixed instance")
        eng.add_request(tr.req)
        tr.location = LocalEngine(eng)
        tr.out_at_place = len(tr.req.output_token_ids)
        eng.wake()

    def relay_ended(self, tr: Tracked) -> None:
        """The relay of `tr` ends by itself (it is about to finish, move or abort `tr`):
        nothing is left to cancel."""
        loc = tr.location
        if type(loc) is RemotePeer and loc.relay is not None:
            tr.location = RemotePeer(loc.instance, None)

    def streamed_elsewhere(self, tr: Tracked, sink: Sink) -> None:
        """A Resume at another daemon took `tr`'s stream over (the peer ended the relay's
        stream with OK and no Finished: one request streams to one place): `tr` leaves this
        daemon unfinished, its outputs going to `sink` (nowhere) from now on; it runs on there
        and the journal record of its owner tells any Resume where. Its stream here ends the
        way a stream taken over by a Resume here does (OK, no Finished; a Session request
        leaves its session)."""
        self.relay_ended(tr)
        self.cancel_reservation(tr)
        self._untrack(tr, sink).notify(tr)

    def _untrack(self, tr: Tracked, sink: Sink) -> Sink:
        """`tr` leaves the table unfinished (nothing finished or journaled here), its outputs
        going to `sink` from now on; returns its old sink."""
        rid = tr.req.req_id
        if self.tracked.get(rid) is tr:
            del self.tracked[rid]
        if not self.tracked:
            self.all_done.set()
        old, tr.sink = tr.sink, sink
        return old

    def redirect(self, tr: Tracked, sink: Sink) -> Sink:
        """Send `tr`'s outputs to `sink` from now on (a Resume); returns the old sink."""
        old, tr.sink = tr.sink, sink
        eng = tr.engine
        if eng is not None:
            eng.sinks_changed()
        return old

    def reserved(self, tr: Tracked, decode: InstanceEngine | None, msg: object = None) -> None:
        """P/D: `decode` holds `tr`'s reservation until the hand-off; None: a peer's decode
        instance takes it at the hand-off (P/D across daemons), forwarded as `msg` (its
        GenerateRequest) with its prefilled tokens."""
        tr.decode_engine = decode
        if decode is None:
            tr.pd_msg = msg

    def cancel_reservation(self, tr: Tracked) -> None:
        d, tr.decode_engine = tr.decode_engine, None
        if d is not None and d.ready:
            try:
                d.abort(tr.req.req_id, FinishReason.ABORT, "prefill ended")
            except RequestNotFound:
                return
            d.wake()

    # ---- aborts ---------------------------------------------------------------------------
    def abort(
        self,
        req_id: str,
        message: str = "aborted by client",
        owner: str | None = None,
        reason: FinishReason = FinishReason.ABORT,
    ) -> None:
        """Abort a live request by id (ending it with `reason`: ABORT, or STOP for a client's
        own stop condition); a recently finished one is a no-op (an abort and a finish may
        cross). RequestNotFound otherwise, or when `owner` did not submit it."""
        tr = self.tracked.get(req_id)
        if tr is None:
            if req_id in self.recent:
                return
            raise RequestNotFound(
                f"no live request with id {req_id!r} (never submitted, or finished long ago)"
            )
        if owner is not None and tr.owner != owner:
            raise RequestNotFound(
                f"no live request with id {req_id!r} submitted with your credentials"
            )
        self.abort_tracked(tr, message, reason)

    def abort_tracked(
        self, tr: Tracked, message: str, reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self.cancel_reservation(tr)
        eng = tr.engine
        if eng is None or not eng.holds(tr.req):
            self.finish(tr, reason, message)  # parked, or on a peer (its relay is cancelled)
            return
        eng.abort(tr.req.req_id, reason, message)
        eng.wake()

    def abort_all(self, message: str) -> None:
        for tr in list(self.tracked.values()):
            self.abort_tracked(tr, message)

    # ---- the one end ----------------------------------------------------------------------
    def finish(self, tr: Tracked, reason: FinishReason | None = None, message: str = "") -> None:
        """`tr`'s one Finished. With `reason`, its request is stamped finished here (no
        scheduler holds it: parked, a failed hand-off, or it ended on a peer); without, its
        engine or its relay has stamped it. A second call is a no-op."""
        req = tr.req
        if reason is not None:
            lifecycle.finish_outside(req, reason, message, time.monotonic())
        self.cancel_reservation(tr)
        if self.tracked.pop(req.req_id, None) is None:
            return
        tr.finished = True
        self.observers.request_finished(tr)
        self.recent[req.req_id] = None
        if len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)
        tr.sink.notify(tr)
        if not self.tracked:
            self.all_done.set()

    # ---- what the engines report (EngineListener) -------------------------------------------
    def on_instance_ready(self, eng: InstanceEngine) -> None:
        """Place parked requests."""
        self.place_parked()

    def on_handed_off(
        self, p: InstanceEngine, req: Request, kv_sent: bool = True, stored: bool = False
    ) -> None:
        """Move a request its prefill instance handed off to its decode reservation: onto the
        pushed KV (`kv_sent`), or placed there anew: its prompt fetched from the storage tier
        (`stored`, as far as it is stored) or recomputed (a failed transfer)."""
        tr = req.tag
        if not isinstance(tr, Tracked) or tr.finished or tr.req is not req:
            return  # (ended while its blocks were being written: aborted, its client gone)
        d, tr.decode_engine = tr.decode_engine, None
        failed = "" if kv_sent or stored else "KV transfer failed and "
        if d is None and tr.pd_msg is not None:  # through the store: no reservation
            self._hand_to_decode(p, tr, req, stored)
            return
        if d is None or not d.ready:
            self.finish(tr, FinishReason.ERROR, f"{failed}decode instance lost before hand-off")
            return
        try:
            if kv_sent:
                dreq = d.add_prefilled(req.req_id, req.output_token_ids, req.num_cached_tokens)
            else:  # the decode instance recomputes the prompt: nothing is lost
                dreq = d.recompute_reserved(req.req_id, req.output_token_ids)
        except RequestNotFound:
            self.finish(tr, FinishReason.ERROR, f"{failed}decode reservation gone before hand-off")
            return
        dreq.tag = tr
        lifecycle.carry_over(req, dreq)  # (add_prefilled set its cached tokens; recomputed,
        # it counts its prompt where it is placed)
        tr.req, tr.location = dreq, LocalEngine(d)
        self.observers.request_progressed(tr)
        d.wake()

    def _hand_to_decode(self, p: InstanceEngine, tr: Tracked, req: Request, stored: bool) -> None:
        """P/D through the storage tier (`stored`: its prompt's full blocks are there; else
        none: the decode side recomputes them): queue `tr` with the tokens it has on a decode
        instance here, placed like a recomputed request (its lookup fetches the stored run);
        with none here, forward it to a peer's decode instance (P/D across daemons), whose
        tokens are relayed to its client (the cluster's forward: one client stream)."""
        msg, tr.pd_msg = tr.pd_msg, None
        try:
            d: InstanceEngine | None = self.registry.route_decode(req, tr.model)
        except Unavailable:
            d = None
        if d is not None:
            dreq = fresh_copy(req)
            dreq.tag = tr
            lifecycle.carry_over(req, dreq)
            d.add_request(dreq)
            tr.req, tr.location = dreq, LocalEngine(d)
            self.observers.request_progressed(tr)
            d.wake()
            return
        cluster = self.cluster
        remote = cluster.decode_peer(tr.model) if cluster is not None else None
        if cluster is None or remote is None:
            self.finish(tr, FinishReason.ERROR, "no decode instance (here or at a peer) now")
            return
        fwd = type(msg)()
        fwd.CopyFrom(msg)
        fwd.prefilled_token_ids[:] = req.output_token_ids
        fwd.stored_prompt_blocks = p.stored_prompt_blocks(req) if stored else 0
        tr.location = RemotePeer(remote, None)
        self.observers.request_progressed(tr)
        self.relay_started(tr, cluster.forward(tr, fwd, remote, {}, None))

    def on_hand_off_failed(self, p: InstanceEngine, req: Request) -> None:
        self.on_handed_off(p, req, kv_sent=False)

    def on_handed_off_stored(self, p: InstanceEngine, req: Request) -> None:
        self.on_handed_off(p, req, kv_sent=False, stored=True)

    def on_finished(self, eng: InstanceEngine, req: Request) -> None:
        tr = req.tag
        if not isinstance(tr, Tracked) or tr.req is not req:
            return  # a decode reservation or a stale copy
        self.finish(tr)

    def requeue_lost(self, old: Request, reason: str, worker_fault: bool = False) -> None:
        """A live request of a lost instance (or of a peer that went away): keep the tokens
        it streamed and recompute it on another instance (or the same one once it
        reconnects), within requeue_timeout_s. Only a loss that is the worker's fault
        (`worker_fault`: its stream broke, or it broke the protocol) counts towards its
        poison quarantine; a lease taken, a silent rank, a peer that went away do not."""
        tr = old.tag
        if not isinstance(tr, Tracked) or tr.req is not old:
            return  # a decode reservation: its prefill side fails the hand-off
        eng = tr.engine
        if tr.decode_engine is not None or (eng is not None and eng.role != Role.MIXED):
            self.finish(tr, FinishReason.ERROR, f"{reason}; disaggregated requests are not moved")
            return
        fault = worker_fault and not self.watchdog.stood_still(time.monotonic())
        quarantined = self.poison.lost(tr, reason) if fault else None
        if quarantined is not None:
            self.telemetry.request_quarantined(tr)
            self.finish(tr, FinishReason.ERROR, quarantined)
            return
        new = fresh_copy(old)
        new.tag = tr
        tr.req = new
        self.observers.request_moved(tr, reason)  # its location still names the lost instance
        tr.location = Parked(time.monotonic() + self.config.requeue_timeout_s, reason)
        self.num_requeued += 1
        self.parked.append(tr)
        self.place_parked()

    # ---- set aside by a self-fenced daemon (kvsched/cluster/selffence.py) --------------------
    def set_aside(self, tr: Tracked, sink: Sink) -> Sink:
        """Take `tr` off its instance (its KV freed, the engine's copy made stale) and out of
        the table, its outputs going to `sink`; nothing is finished or journaled. Returns its
        old sink."""
        self.cancel_reservation(tr)
        eng, old = tr.engine, tr.req
        if eng is not None and eng.holds(old):
            tr.req = fresh_copy(old)
            with contextlib.suppress(KvschedError):
                eng.abort(old.req_id, FinishReason.ABORT, "self-fenced: set aside")
            eng.wake()
        tr.location = Parked(math.inf, "set aside")
        return self._untrack(tr, sink)

    def take_back(self, tr: Tracked, deadline: float, reason: str) -> bool:
        """Track a request set aside again (parked until `deadline`); False when a record of
        its id is tracked meanwhile (never two here)."""
        rid = tr.req.req_id
        if rid in self.tracked:
            return False
        tr.location = Parked(deadline, reason)
        self.tracked[rid] = tr
        self.all_done.clear()
        self.parked.append(tr)
        return True

    # ---- parked requests ------------------------------------------------------------------
    def place_parked(self) -> None:
        """Place parked requests (their instance was lost, or recovered from the journal);
        fail those past their deadline. The walk takes the list: a request parked while it
        runs (a finish's observers may lose an instance, whose requests `requeue_lost` parks
        and places in a walk of their own) goes into a new one, kept after the walk."""
        now, keep = time.monotonic(), []
        walked, self.parked = self.parked, []
        for tr in walked:
            loc = tr.location
            if self.tracked.get(tr.req.req_id) is not tr or type(loc) is not Parked:
                continue  # aborted meanwhile
            # A sample goes where its group's prompt is computed now (groups.py), if anywhere.
            eng = self.registry.group_engine(tr.req, tr.model) or self.registry.route_moved(
                tr.req, tr.model
            )
            if eng is not None and not self.poison.may_place(tr, self._live):
                eng = None  # a suspect waits for the one on trial (server/requests/poison.py)
            if eng is not None:
                try:
                    eng.add_request(tr.req)
                except KvschedError as exc:
                    why = f"{loc.reason}; cannot move to {eng.instance_id}: {exc}"
                    self.finish(tr, FinishReason.ERROR, why)
                    continue
                tr.location = LocalEngine(eng)
                tr.out_at_place = len(tr.req.output_token_ids)
                eng.wake()
            elif now >= loc.deadline:
                self.finish(
                    tr,
                    FinishReason.ERROR,
                    f"unavailable: {loc.reason}; no instance could take the request within "
                    f"{self.config.requeue_timeout_s:g} s",
                )
            else:
                keep.append(tr)
        kept = {id(tr) for tr in keep}
        for tr in self.parked:  # parked during the walk: kept too, each once
            if id(tr) not in kept:
                kept.add(id(tr))
                keep.append(tr)
        self.parked = keep

    def _live(self, tr: Tracked) -> bool:
        return self.tracked.get(tr.req.req_id) is tr and tr.on_engine()

    # ---- the watchdog's checks ------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Abort the requests still tracked whose queue timeout or deadline has passed
        (`Watchdog.expired`: a heap, O(expired) per tick)."""
        for tr, why in self.watchdog.expired(now):
            if self.tracked.get(tr.req.req_id) is tr:
                self.abort_tracked(tr, why)
