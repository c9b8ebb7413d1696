"""The request table: every request the daemon tracks, from acceptance to its one Finished.

A request's daemon-side state is a `Tracked` (stored in `Request.tag`): which instance holds it,
where its outputs go (a sink: one Generate stream or one Session stream), how many tokens that
sink has been sent, whether it has finished. Every accepted request ends in exactly one
`Finished` delivered to its sink. The table also owns what ends requests from outside an
engine: aborts, queue timeouts and deadlines, streams that stopped reading, requests of lost
instances waiting for another one (orphans), and P/D decode reservations. Engines report to it
through `EngineListener`.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvsched import codec
from kvsched.core import (
    FinishReason,
    InvalidRequest,
    KvschedError,
    Request,
    RequestNotFound,
    Role,
    Unavailable,
)
from kvsched.core.request import FINISHED_STATUS
from kvsched.server.engine import InstanceEngine
from kvsched.server.models import too_long
from kvsched.server.poison import PoisonGuard
from kvsched.v1 import request_service_pb2

if TYPE_CHECKING:
    from kvsched.server.config import ServerConfig
    from kvsched.server.registry import InstanceRegistry
    from kvsched.server.telemetry import Telemetry

log = logging.getLogger("kvsched.daemon")

RECENT_FINISHED = 10_000  # ids remembered so a late Abort of a finished request is a no-op


class Sink(Protocol):
    """Where a request's outputs go. `notify`: it has news (it finished: `Tracked.finished`).
    `add_tokens`: new output tokens of several requests, in order, each request at most once:
    trs[i] produced counts[i] tokens (counts None: one each), consecutive in toks. The same
    tokens are already in each request's `output_token_ids`: a sink may take them from the
    call (a Session joins the deltas) or take the call as news and read its requests (a
    Generate stream sends `output_token_ids` past `Tracked.sent`)."""

    def notify(self, tr: Tracked, /) -> None: ...

    def add_tokens(
        self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /
    ) -> None: ...


@dataclass(slots=True, eq=False)
class Tracked:
    req: Request  # the current core request (a decode instance's copy after hand-off)
    engine: InstanceEngine
    sink: Sink
    detachable: bool = False
    owner: str = ""
    client_tag: str = ""
    sent: int = 0  # output tokens handed to the sink
    decode_engine: InstanceEngine | None = None  # P/D: holds a reservation until hand-off
    span: Any = None
    finished: bool = False  # its one Finished is decided: the table no longer tracks it
    forward: Any = None  # cluster: the task relaying it from a peer's instance (engine: remote)
    durable: int = 0  # journal: 0 not journaled, 1 accepted record in flight, 2 stored, 3 closed
    journaled: int = 0  # output tokens the journal has recorded
    held: bool = False  # a Session holds its outputs until the journal stored it
    model: str = ""  # the model it runs on (a lost instance's request moves within it)
    losses: int = 0  # instance losses it is a suspect of (server/poison.py)
    out_at_place: int = 0  # output tokens it had when last placed


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
        self.orphans: list[tuple[Tracked, float, str]] = []  # lost instance, deadline, why
        self.timers: list[tuple[float, int, Tracked, str]] = []  # heap: when, seq, request, kind
        self._timer_seq = 0
        self.streams: set[Any] = set()  # open Generate / Session sinks (stall watchdog)
        self.num_requeued = 0
        self.poison = PoisonGuard(config.poison_max_losses)
        # A cluster's routing and forwarding (kvsched.cluster.node.ClusterNode; None: alone):
        # `route_new(req, carrier, owner)` -> (an engine here or a peer's instance, the owner
        # to track it under), `forward(tr, pb, remote, carrier, deadline_s)`, and
        # `abort_elsewhere(request_id, owner)` (awaited by the Abort RPC).
        self.cluster: Any = None
        # The journal when durability is on (kvsched.durability.journal.Journal): told of
        # finishes and of requests moved off a lost instance.
        self.journal: Any = None

    # ---- requests ---------------------------------------------------------------------------
    def submit(
        self,
        pb: request_service_pb2.GenerateRequest,
        sink: Sink,
        owner: str = "",
        client_tag: str = "",
        carrier: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> Tracked:
        """Validate, route and queue one request. Raises a typed error (nothing is kept) or
        returns its Tracked state; from then on the sink gets exactly one Finished."""
        if self.draining:
            raise Unavailable("kvsched is draining (shutting down): not accepting new requests")
        model = self.registry.model_for(pb.model)
        req_id = pb.request_id or uuid.uuid4().hex
        if req_id in self.tracked:
            raise InvalidRequest(f"request_id {req_id!r} is already in use by a live request")
        limit = self.registry.largest_max_model_len()
        if len(pb.prompt_token_ids) > limit:  # before the prompt becomes a Python list
            raise too_long(pb, req_id, limit, self.config.default_max_tokens)
        req = codec.request_from_proto(pb, req_id, time.monotonic(), self.config.default_max_tokens)
        cluster = self.cluster
        if cluster is None:
            eng = self.registry.route(req, model)
        else:
            eng, owner = cluster.route_new(req, carrier or {}, owner, model)
            if not isinstance(eng, InstanceEngine):  # a peer's instance: forward it there
                return self._forward(req, eng, pb, sink, owner, client_tag, carrier, deadline_s)
        tr = Tracked(req, eng, sink, pb.detachable, owner, client_tag, model=model)
        if eng.role == Role.PREFILL:
            tr.decode_engine = self._reserve_decode(req)
        try:
            eng.add_request(req)
        except Exception:
            self._cancel_reservation(tr)
            raise
        req.tag = tr
        self.tracked[req_id] = tr
        self.all_done.clear()
        now = time.monotonic()
        if self.config.queue_timeout_s > 0:
            self._timer(now + self.config.queue_timeout_s, tr, "queue")
        if deadline_s is not None:
            self._timer(now + deadline_s, tr, "deadline")
        self.telemetry.request_accepted(tr, carrier or {})
        eng.wake()
        return tr

    def _forward(
        self,
        req: Request,
        remote: Any,
        pb: request_service_pb2.GenerateRequest,
        sink: Sink,
        owner: str,
        client_tag: str,
        carrier: Mapping[str, str] | None,
        deadline_s: float | None,
    ) -> Tracked:
        """Track a request that runs on a peer's instance (the cluster relays its outputs)."""
        tr = Tracked(req, remote, sink, pb.detachable, owner, client_tag)
        req.tag = tr
        self.tracked[req.req_id] = tr
        self.all_done.clear()
        if deadline_s is not None:
            self._timer(time.monotonic() + deadline_s, tr, "deadline")
        self.telemetry.request_accepted(tr, carrier or {})
        self.cluster.forward(tr, pb, remote, dict(carrier or {}), deadline_s)
        return tr

    def _reserve_decode(self, req: Request) -> InstanceEngine:
        d = self.registry.route_decode()
        got = d.preallocate(req)
        if got is None:
            raise Unavailable(
                f"decode instance {d.instance_id} has no free slot or blocks for this request now; retry"
            )
        handle, blocks = got
        req.kv_target = (d.instance_id, handle, blocks)
        d.wake()
        return d

    def _cancel_reservation(self, tr: Tracked) -> None:
        d, tr.decode_engine = tr.decode_engine, None
        if d is not None and d.ready:
            try:
                d.abort(tr.req.req_id, FinishReason.ABORT, "prefill ended")
            except RequestNotFound:
                return
            d.wake()

    def abort(
        self, req_id: str, message: str = "aborted by client", owner: str | None = None
    ) -> None:
        """Abort a live request by id; a recently finished one is a no-op (an abort and a finish
        may cross). RequestNotFound otherwise, or when `owner` did not submit it."""
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
        self.abort_tracked(tr, message)

    def abort_tracked(
        self, tr: Tracked, message: str, reason: FinishReason = FinishReason.ABORT
    ) -> None:
        self._cancel_reservation(tr)
        eng = tr.engine
        if not eng.holds(tr.req):
            self._fail(tr, message, reason)  # orphaned: waiting for an instance
            return
        eng.abort(tr.req.req_id, reason, message)
        eng.wake()

    def abort_all(self, message: str) -> None:
        for tr in list(self.tracked.values()):
            self.abort_tracked(tr, message)

    # ---- what the engines report (EngineListener) ---------------------------------------------
    def on_instance_ready(self, eng: InstanceEngine) -> None:
        """Place requests waiting for an instance."""
        self.place_orphans()

    def on_handed_off(self, p: InstanceEngine, req: Request) -> None:
        tr = req.tag
        if not isinstance(tr, Tracked):
            return
        d, tr.decode_engine = tr.decode_engine, None
        if d is None or not d.ready:
            self._fail(tr, "decode instance lost before hand-off")
            return
        try:
            dreq = d.add_prefilled(req.req_id, req.output_token_ids, req.num_cached_tokens)
        except RequestNotFound:
            self._fail(tr, "decode reservation gone before hand-off")
            return
        dreq.tag = tr
        dreq.arrival_time, dreq.first_token_time = req.arrival_time, req.first_token_time
        dreq.first_scheduled_time = req.first_scheduled_time
        dreq.num_cached_tokens = req.num_cached_tokens
        tr.req, tr.engine = dreq, d
        if self.journal is not None:
            self.journal.progress(tr)
        d.wake()

    def on_finished(self, eng: InstanceEngine, req: Request) -> None:
        tr = req.tag
        if not isinstance(tr, Tracked) or tr.req is not req:
            return  # a decode reservation or a stale copy
        self._cancel_reservation(tr)
        if self.tracked.pop(req.req_id, None) is None:
            return
        if tr.forward is not None:  # ended here first (abort, drop): the peer aborts it too
            tr.forward.cancel()
            tr.forward = None
        tr.finished = True
        if self.journal is not None:
            self.journal.finished(tr)
        self.recent[req.req_id] = None
        if len(self.recent) > RECENT_FINISHED:
            self.recent.popitem(last=False)
        self.telemetry.request_finished(tr)
        tr.sink.notify(tr)
        if not self.tracked:
            self.all_done.set()

    def requeue_lost(self, old: Request, reason: str) -> None:
        """A live request of a lost instance: keep the tokens it streamed and recompute it on
        another instance (or the same one once it reconnects), within requeue_timeout_s."""
        tr = old.tag
        if not isinstance(tr, Tracked) or tr.req is not old:
            return  # a decode reservation: its prefill side fails the hand-off
        if tr.decode_engine is not None or tr.engine.role != Role.MIXED:
            self._fail(tr, f"{reason}; disaggregated requests are not moved")
            return
        quarantined = self.poison.lost(tr, reason)
        if quarantined is not None:
            self.telemetry.request_quarantined(tr)
            self._fail(tr, quarantined)
            return
        new = Request(
            old.req_id,
            old.prompt_token_ids,
            old.sampling,
            old.priority,
            old.arrival_time,
            old.lora_name,
            old.cache_salt,
            old.mm_ranges,
            tenant=old.tenant,
        )
        # No ttft_deadline_ms: an accepted request is never shed when it moves (its implicit
        # deadline from its first arrival keeps its place among the moved ones).
        new.output_token_ids = list(old.output_token_ids)
        # Its prefix hit is counted anew where it is placed next: the lost instance's cache
        # served the tokens it streamed, not the recomputation that will finish it.
        new.num_preemptions = old.num_preemptions
        new.first_scheduled_time, new.first_token_time = (
            old.first_scheduled_time,
            old.first_token_time,
        )
        new.tag = tr
        tr.req = new
        if self.journal is not None:
            self.journal.progress(tr)
        self.telemetry.request_moved(tr, reason)
        self.num_requeued += 1
        self.orphans.append((tr, time.monotonic() + self.config.requeue_timeout_s, reason))
        self.place_orphans()

    # ---- requests no engine holds -------------------------------------------------------------
    def place_orphans(self) -> None:
        """Route requests whose instance was lost; fail those past their deadline."""
        now, keep = time.monotonic(), []
        for tr, deadline, reason in self.orphans:
            if self.tracked.get(tr.req.req_id) is not tr:
                continue  # aborted meanwhile
            eng = self.registry.route_moved(tr.req, tr.model)
            if eng is not None and not self.poison.may_place(tr, self._live):
                eng = None  # a suspect waits for the one on trial (server/poison.py)
            if eng is not None:
                try:
                    eng.add_request(tr.req)
                except KvschedError as exc:
                    self._fail(tr, f"{reason}; cannot move to {eng.instance_id}: {exc}")
                    continue
                tr.engine = eng
                tr.out_at_place = len(tr.req.output_token_ids)
                eng.wake()
            elif now >= deadline:
                self._fail(
                    tr,
                    f"unavailable: {reason}; no instance could take the request within "
                    f"{self.config.requeue_timeout_s:g} s",
                )
            else:
                keep.append((tr, deadline, reason))
        self.orphans = keep

    def _live(self, tr: Tracked) -> bool:
        return self.tracked.get(tr.req.req_id) is tr and tr.engine.holds(tr.req)

    def _fail(self, tr: Tracked, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        """End a request no scheduler holds (orphaned, hand-off failed)."""
        req = tr.req
        req.status = FINISHED_STATUS[reason]
        req.finish_reason, req.finish_message = reason, message
        req.finished_time = time.monotonic()
        self.on_finished(tr.engine, req)

    # ---- the watchdog's checks ------------------------------------------------------------------
    def _timer(self, when: float, tr: Tracked, kind: str) -> None:
        self._timer_seq += 1
        heapq.heappush(self.timers, (when, self._timer_seq, tr, kind))

    def expire(self, now: float) -> None:
        """Queue timeouts and deadlines that have passed (a heap: O(expired) per tick)."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, tr, kind = heapq.heappop(timers)
            if self.tracked.get(tr.req.req_id) is not tr:
                continue
            if kind == "deadline":
                self.abort_tracked(tr, "deadline exceeded (the call's gRPC deadline passed)")
            elif tr.req.first_scheduled_time < 0:
                self.abort_tracked(
                    tr, f"queue timeout: not scheduled within {self.config.queue_timeout_s:g} s"
                )

    def cut_stalled(self, now: float) -> None:
        """Cut streams with news their client has not read for more than stall_timeout_s."""
        limit = self.config.stall_timeout_s
        for sink in list(self.streams):
            since = sink.pending_since
            if since is not None and now - since > limit and sink.task is not None:
                log.warning("cutting a stream that has not read its outputs for %.1f s", limit)
                sink.stalled = True
                self.streams.discard(sink)
                sink.task.cancel()
