"""Accepting a request: validate, choose where it runs, send it there, track it.

    submit()   validate the message and its limits, choose an instance (this daemon's
               registry, or in a cluster `route_new`: here or a peer's instance), then send
               it: queue it on the local engine (with a P/D decode reservation when the
               instance is a prefill one) or start the cluster's relay to the peer; the
               table tracks it from then on (`RequestTable.track`)
    accept()   submit, then, when this daemon journals it, wait until the journal stores its
               accepted record (the GPU does not wait: it is queued already); a record that
               cannot be stored aborts it and raises Unavailable

Choosing returns a value (an engine here, or a peer's instance); nothing is queued or
forwarded until the choice is made, and a refusal leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvsched import codec
from kvsched.core import InvalidRequest, Request, Role, Unavailable
from kvsched.core.config import PdTransfer
from kvsched.core.errors import RequestAlreadyLive
from kvsched.core.slots import set_output
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.instances.models import too_long
from kvsched.server.requests.durable import Durability
from kvsched.server.requests.record import LocalEngine, RemotePeer, Sink, Tracked
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import request_service_pb2

if TYPE_CHECKING:
    from kvsched.server.cluster_port import ClusterPort
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.instances.registry import InstanceRegistry


class Acceptor:
    """Validates, routes, sends and tracks new requests. Its collaborators are handed in by
    the composition root: the request table (which also holds the cluster port once this
    daemon joins one), the instance registry (models, limits, routing), the config and the
    journal glue."""

    def __init__(
        self,
        table: RequestTable,
        registry: InstanceRegistry,
        config: ServerConfig,
        durable: Durability,
    ) -> None:
        self.table = table
        self.registry = registry
        self.config = config
        self.durable = durable

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
        returns its record; from then on the sink gets exactly one Finished."""
        table, registry, config = self.table, self.registry, self.config
        if table.draining:
            raise Unavailable("kvsched is draining (shutting down): not accepting new requests")
        model, lora = registry.model_and_lora(pb.model, pb.lora_name)
        if lora != pb.lora_name:  # `model` named the adapter: the message says it plainly
            pb.model, pb.lora_name = model, lora  # (so its journal record and forwards do)
        req_id = pb.request_id or uuid.uuid4().hex
        live = table.tracked.get(req_id)
        if live is not None:
            relayed_from_caller(live, carrier, table.cluster)
            raise _in_use(req_id, live, pb, model)
        limit = registry.largest_max_model_len()
        if len(pb.prompt_token_ids) > limit:  # before the prompt becomes a Python list
            raise too_long(pb, req_id, limit, config.default_max_tokens)
        req = codec.request_from_proto(pb, req_id, time.monotonic(), config.default_max_tokens)
        carrier = carrier or {}
        cluster = table.cluster
        if pb.prefilled_token_ids or pb.stored_prompt_blocks:  # a peer's P/D hand-off
            if cluster is None or not cluster.from_peer(carrier, owner):
                raise InvalidRequest(
                    "prefilled_token_ids and stored_prompt_blocks are set only by a peer "
                    "daemon handing off a request it prefilled; leave them empty"
                )
            set_output(req, list(pb.prefilled_token_ids))
        # Choose (a value: an engine here, or a peer's instance) ...
        if cluster is None:
            eng = registry.route(req, model)
        else:
            chosen, owner = cluster.route_new(req, dict(carrier), owner, model)
            if not isinstance(chosen, InstanceEngine):
                # ... send: relay it to the peer's instance (that daemon journals it).
                tr = Tracked(
                    req, RemotePeer(chosen), sink, pb.detachable, owner, client_tag, model=model
                )
                table.track(tr, carrier, deadline_s, queue_timeout=False)
                relay = cluster.forward(tr, pb, chosen, dict(carrier), deadline_s)
                table.relay_started(tr, relay)
                return tr
            eng = chosen
        # ... send: queue it on the engine chosen.
        tr = Tracked(req, LocalEngine(eng), sink, pb.detachable, owner, client_tag, model=model)
        if eng.role == Role.PREFILL:
            # (None: handed off to a peer's decode instance, through the storage tier)
            table.reserved(tr, self._reserve_decode(req, eng, model), pb)
        elif pb.stored_prompt_blocks:  # a peer stored the prompt's first blocks for it
            eng.trust_stored(req, pb.stored_prompt_blocks)
        try:
            eng.add_request(req)
        except Exception:
            table.cancel_reservation(tr)
            raise
        table.track(tr, carrier, deadline_s, queue_timeout=True)
        eng.wake()
        return tr

    def _reserve_decode(self, req: Request, p: InstanceEngine, model: str) -> InstanceEngine | None:
        """A decode reservation here for the prefill instance `p`'s request (the push's target
        blocks); None when `p` hands off through the storage tier: the decode instance (here,
        else a peer daemon's) is chosen at the hand-off and fetches into blocks of its own, so
        nothing is reserved (Unavailable when there is none now, here or at a peer)."""
        if p.engine_config.cache.pd_transfer == PdTransfer.STORAGE:
            with contextlib.suppress(Unavailable):  # one here (of the model, the adapter)
                self.registry.route_decode(req, model)
                return None
            cluster = self.table.cluster
            if cluster is not None and cluster.decode_peer(model, count=False) is not None:
                return None
        d = self.registry.route_decode(req, model)
        got = d.preallocate(req)
        if got is None:
            slot = (
                "slot, blocks or LoRA adapter slot (max_loras)"
                if req.lora_name
                else "slot or blocks"
            )
            raise Unavailable(
                f"decode instance {d.instance_id} has no free {slot} for this request now; retry"
            )
        handle, blocks = got
        req.kv_target = (d.instance_id, handle, blocks)
        d.wake()
        return d

    async def accept(
        self,
        pb: request_service_pb2.GenerateRequest,
        sink: Sink,
        owner: str = "",
        client_tag: str = "",
        carrier: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> Tracked:
        """Accept one request: queued on its instance at once, returned once its accepted
        record is stored when this daemon journals it (`Durability.confirm`), or, forwarded
        to a peer's instance, once that peer accepted it."""
        tr = self.submit(pb, sink, owner, client_tag, carrier, deadline_s)
        # A request forwarded to a peer's instance is journaled by that peer, its owner (the
        # forwarded call comes through this same path there), never twice. Its client is told
        # `queued` only once the peer has answered (after its journal stored the request):
        # told before, a client whose daemon died in between would hold a `queued` for a
        # request no journal has (the 30-minute nemesis run lost one so).
        if self.durable.journals(tr):
            await self.durable.confirm(tr, pb)
        elif type(tr.location) is RemotePeer and (cluster := self.table.cluster) is not None:
            try:
                await cluster.forward_confirmed(tr)
            except asyncio.CancelledError:  # its client went away before `queued`
                if not tr.detachable and tr.sink is sink and not tr.finished:
                    self.table.abort_tracked(tr, "client stream closed before it was queued")
                raise
        return tr


def relayed_from_caller(
    tr: Tracked, carrier: Mapping[str, str] | None, cluster: ClusterPort | None
) -> None:
    """Unavailable when a peer forwards (or resumes) here a request this daemon only relays
    from that very peer: followed here, the request would go round between the two, each
    relaying the other's relay, and nobody would run it (the 30-minute nemesis run of 592748b
    lost a request so: d2 followed it at d1, which then forwarded it to d2). Refused, the
    peer places it elsewhere (or runs it itself) and this daemon's relay goes on reading it."""
    loc = tr.location
    if cluster is None or carrier is None or type(loc) is not RemotePeer:
        return
    peer = cluster.forwarded_by(carrier)
    if peer and peer == loc.instance.daemon_id:
        raise Unavailable(
            f"request {tr.req.req_id!r} is relayed to this daemon from daemon {peer}: "
            "it cannot be followed here from there; place it elsewhere"
        )


def _in_use(
    req_id: str, live: Tracked, pb: request_service_pb2.GenerateRequest, model: str
) -> InvalidRequest:
    """The refusal of a request whose id `live` holds: `RequestAlreadyLive` when it is the same
    request sent again (same model, same prompt; a forwarder's earlier forward that reached
    this daemon, its call broken since), which a forwarder follows here by Resume; a plain
    InvalidRequest when the id was reused for another request."""
    why = f"request_id {req_id!r} is already in use by a live request"
    if live.model == model and pb.prompt_token_ids == live.req.prompt_token_ids:
        return RequestAlreadyLive(f"{why} (the same request: Resume follows it)")
    return InvalidRequest(why)
