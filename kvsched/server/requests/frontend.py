"""RequestService: Generate (one request per stream), Abort, Session (many per stream).

Sinks never queue tokens: the tokens live in the core request, and a sink only remembers which
requests have something new. A slow reader therefore gets larger batches, not a growing buffer,
and a Session's memory is bounded by its open requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvsched import codec
from kvsched.core import FinishReason, InvalidRequest, KvschedError, RequestNotFound, Unavailable
from kvsched.server.auth import current_principal
from kvsched.server.errors import DeadlinePassed, status_for
from kvsched.server.requests.accept import Acceptor, relayed_from_caller
from kvsched.server.requests.durable import Durability
from kvsched.server.requests.record import RemotePeer, Tracked
from kvsched.server.requests.resume import OwnedElsewhere, Resumer
from kvsched.server.requests.sinks import (
    SessionSink,
    StreamSink,
    _token_columns,
    fill_delta_logprobs,
    fill_logprobs,
    raise_limit,
    sink_close_reason,
)
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import request_service_pb2 as pb
from kvsched.v1 import request_service_pb2_grpc

log = logging.getLogger("kvsched.frontend")

# Sent as a Session opens: this daemon takes SessionRequest.batch, messages up to this many
# bytes (request_service.proto; kvsched.client.batch).
BATCH_HEADER = "kvsched-session-batch"


def metadata(context: Any) -> dict[str, str]:
    """The call's metadata as a dict (trace context travels here)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def principal(context: Any) -> str:
    """The authenticated caller, as set by the auth interceptor ('' without auth)."""
    return current_principal.get()


def _abort_reason(value: int) -> tuple[FinishReason, str]:
    """AbortRequest.reason: ABORT (also unspecified), or STOP for the client's own stop."""
    if value in (FinishReason.NONE, FinishReason.ABORT):
        return FinishReason.ABORT, "aborted by client"
    if value == FinishReason.STOP:
        return (
            FinishReason.STOP,
            "stopped by client (a stop condition it checks, e.g. a stop string)",
        )
    raise InvalidRequest(f"AbortRequest.reason must be ABORT or STOP, got {value}")


class RequestServicer(request_service_pb2_grpc.RequestServiceServicer):
    """Accepts requests into the request table and streams their outputs back."""

    def __init__(
        self,
        acceptor: Acceptor,
        resumer: Resumer,
        durable: Durability,
        requests: RequestTable,
        max_session_requests: int,
        max_message_bytes: int = 4 << 20,
    ) -> None:
        self.acceptor = acceptor
        self.resumer = resumer
        self.durable = durable
        self.requests = requests
        self.max_session_requests = max_session_requests
        self.batch_header = ((BATCH_HEADER, str(max_message_bytes)),)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        sink = StreamSink(len(request.prefilled_token_ids))  # a peer's P/D hand-off has them
        carrier = metadata(context)
        try:
            tr = await self.acceptor.accept(
                request,
                sink,
                owner=principal(context),
                carrier=carrier,
                deadline_s=context.time_remaining(),
            )
        except KvschedError as exc:
            self._refused(request, exc, carrier)
            raise
        async for msg in self._follow(tr, sink, pb.GenerateResponse, context):
            yield msg

    async def Resume(
        self, request: pb.RequestServiceResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RequestServiceResumeResponse]:
        sink = StreamSink(len(request.token_ids) or request.num_tokens_received)  # caller has them
        carrier, node = metadata(context), self.requests.cluster
        owner = principal(context) if node is None else node.caller_of(carrier, principal(context))
        here = self.requests.tracked.get(request.request_id)
        if node is not None and here is None:
            node.refuse_if_fenced()  # a fenced daemon answers at once: resume elsewhere
        giver = "" if node is None else node.hand_over_from(carrier, principal(context))
        if giver and request.request_id in self.requests.tracked:
            # This daemon accepted it and forwarded it to `giver`: adopted back, it continues
            # here (Resumer.recover's rule for a request forwarded to a dead daemon), not there.
            await self.resumer.recover(giver, only=request.request_id)
            raise Unavailable(
                f"request {request.request_id!r} continues at the daemon that accepted it"
            )
        if here is not None:
            relayed_from_caller(here, carrier, node)  # never followed round in a circle
        try:
            got = await self.resumer.resume(request, owner, sink)
        except OwnedElsewhere as exc:
            if node is None:
                raise
            mine = exc.daemon_id == node.daemon_id
            if not mine and node.adopting(exc.daemon_id):
                # Read before this daemon's takeover pass of its (dead) owner stored it here:
                # once the pass ends it is served from the table if adopted here, not refused
                # as the dead daemon's (the client would try the other daemons first).
                await node.takeovers_settled()
                if request.request_id in self.requests.tracked:
                    got = await self.resumer.resume(request, owner, sink)
                    if isinstance(got, Tracked):
                        async for msg in self._follow(
                            got, sink, pb.RequestServiceResumeResponse, context
                        ):
                            yield msg
                        return
            if mine or (giver and giver == exc.daemon_id):
                # Its owner hands it over: adopted here (the journal's CAS), then resumed. Or
                # its record names this daemon, which does not run it (an accept whose write
                # landed after its call had given up and been refused): recovered from this
                # daemon's journal now, as at a restart, then resumed. Or it is being adopted
                # here this instant (a takeover pass stores its record here before the CAS):
                # that pass parks it, and it is served from the table, not read again.
                rid = request.request_id
                if mine:
                    await node.takeovers_settled()
                if not (mine and rid in self.requests.tracked):
                    await self.resumer.recover("" if mine else exc.daemon_id, only=rid)
                got = await self.resumer.resume(request, owner, sink)
                if isinstance(got, Tracked):
                    async for msg in self._follow(
                        got, sink, pb.RequestServiceResumeResponse, context
                    ):
                        yield msg
                    return
                raise Unavailable(
                    f"request {request.request_id!r} finished before it was handed over"
                ) from None
            try:  # another daemon owns it: relay its stream (see ClusterNode.resume_at)
                async for out in node.resume_at(exc.daemon_id, request, owner, carrier):
                    yield out
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            return
        if isinstance(got, Tracked):
            async for msg in self._follow(got, sink, pb.RequestServiceResumeResponse, context):
                yield msg
            return
        # Finished: the rest of its outputs and its Finished, from the journal's record.
        have = len(request.token_ids) or request.num_tokens_received
        yield pb.RequestServiceResumeResponse(
            queued=pb.GenerateResponse.Queued(request_id=request.request_id)
        )
        if len(got.tokens) > have:
            rest = got.tokens[have:]
            yield pb.RequestServiceResumeResponse(tokens=pb.GenerateResponse.Tokens(token_ids=rest))
        yield pb.RequestServiceResumeResponse(finished=got.finished)

    async def _follow(
        self, tr: Tracked, sink: StreamSink, kind: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        """A request's stream: queued, its tokens past `sink.sent`, its one finished. Ends
        quietly when a Resume took the request over (`tr.sink` is another sink), and with
        DEADLINE_EXCEEDED when the request was aborted once the call's deadline had passed (the
        watchdog's deadline timer, or any abort racing it): the client's runtime reports its
        deadline so, whichever of the two sides notices first."""
        done = False
        self.requests.streams.add(sink)
        try:
            yield kind(
                queued=pb.GenerateResponse.Queued(request_id=tr.req.req_id, instance=tr.instance_id)
            )
            while True:
                await sink.wait()
                if tr.sink is not sink:
                    done = True  # resumed elsewhere: one request streams to one place
                    if sink.moved:  # taken from this stream (cluster/selffence.py): resume it
                        raise Unavailable(sink.moved)
                    return
                # The tokens past what the client has, pulled off the request (`StreamSink.take`
                # says how they got there and what the read moves), and whether it finished.
                start = sink.sent
                delta, finished = sink.take(tr)
                if delta:
                    toks = pb.GenerateResponse.Tokens(token_ids=delta)
                    if tr.req.logprobs is not None:  # only a request that asked
                        fill_logprobs(toks, tr.req, start, len(delta))
                    yield kind(tokens=toks)
                if finished:
                    done = True
                    if tr.req.finish_reason is FinishReason.ABORT and _deadline_passed(context):
                        raise DeadlinePassed(
                            f"request {tr.req.req_id!r}: {tr.req.finish_message or 'aborted'}"
                        )
                    yield kind(finished=codec.finished_to_proto(tr.req))
                    return
        finally:
            self.requests.streams.discard(sink)
            if not done and not tr.detachable and tr.sink is sink:
                self.requests.abort_tracked(tr, sink_close_reason(sink))

    def _refused(self, request: pb.GenerateRequest, exc: KvschedError, carrier: Any) -> None:
        """Count, log and trace a refused submission (server/telemetry/refusals.py)."""
        code, message = status_for(exc)
        reason = code.name.lower()
        if self.requests.draining:
            reason = "draining"
        elif code.name == "UNAVAILABLE" and "journal" in message:
            reason = "journal_unavailable"
        self.requests.telemetry.request_refused(request.request_id, reason, message, carrier)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        """The models this daemon's instances serve (and, in a cluster, its peers'), then the
        LoRA adapters their workers announced, each with its base model as `parent`."""
        out = pb.ListModelsResponse()
        table = self.requests.registry.model_table()
        for name, (mml, vocab, ready) in sorted(table.items()):
            out.models.add(name=name, max_model_len=mml, vocab_size=vocab, ready_instances=ready)
        for name, (parent, path, ready) in sorted(self.requests.registry.adapter_table().items()):
            mml, vocab, _ = table.get(parent, (0, 0, 0))
            out.models.add(
                name=name,
                max_model_len=mml,
                vocab_size=vocab,
                ready_instances=ready,
                parent=parent,
                root=path,
            )
        return out

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        cluster = self.requests.cluster
        owner = principal(context) or None
        if cluster is not None and owner is not None:  # a peer's relayed abort: its client's
            owner = cluster.caller_of(metadata(context), owner) or None
        reason, message = _abort_reason(request.reason)
        try:
            self.requests.abort(request.request_id, message, owner=owner, reason=reason)
        except RequestNotFound:
            if cluster is None or not await cluster.abort_elsewhere(
                request.request_id, owner, reason
            ):
                raise
        return pb.AbortResponse()

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.SessionResponse]:
        await context.send_initial_metadata(self.batch_header)
        sink = SessionSink()
        owner = principal(context)
        carrier = metadata(context)
        reader = asyncio.get_running_loop().create_task(
            self._read_session(request_iterator, sink, owner, carrier)
        )
        self.requests.streams.add(sink)
        try:
            while True:
                await sink.wait()
                if reader.done() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                msg = self._batch(sink)
                if msg is not None:
                    yield msg
                # Done only when nothing is left to tell: news may have arrived during the yield.
                if sink.client_done and not (
                    sink.open or sink.dirty or sink.errors or sink.accepted or sink.chunks
                ):
                    return
        finally:
            self.requests.streams.discard(sink)
            reader.cancel()
            sink.closed = True  # submits still at the journal are aborted when they land
            why = sink_close_reason(sink)
            for tr in [*sink.open.values(), *sink.held.values()]:
                if not tr.detachable and tr.sink is sink:
                    self.requests.abort_tracked(tr, why)

    async def _read_session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        sink: SessionSink,
        owner: str,
        carrier: dict[str, str],
    ) -> None:
        limit = self.max_session_requests
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "submit":
                    # With the journal, submits wait for it concurrently: one round trip each,
                    # overlapped (no task each: the acknowledgement's callback tells the client).
                    self._submit(msg.submit, sink, owner, limit, carrier)
                elif kind == "batch":  # a burst in one read: each as if sent alone, in order
                    for submit in msg.batch.submits:
                        self._submit(submit, sink, owner, limit, carrier)
                    if not msg.batch.submits:
                        sink.errors.append(
                            pb.SessionResponse.Error(
                                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                message="SessionRequest.batch holds no submit: put at least "
                                "one in `submits` (or send a single `submit`)",
                            )
                        )
                elif kind == "abort":
                    rid = msg.abort.request_id
                    tr = sink.open.get(rid) or sink.held.get(rid)
                    if tr is None:
                        sink.errors.append(
                            pb.SessionResponse.Error(
                                request_id=msg.abort.request_id,
                                code=grpc.StatusCode.NOT_FOUND.value[0],
                                message=f"no open request {msg.abort.request_id!r} on this session",
                            )
                        )
                    else:
                        self._abort_in_session(tr, msg.abort, sink)
                else:
                    sink.errors.append(
                        pb.SessionResponse.Error(
                            code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            message="SessionRequest must set `submit`, `batch` or `abort`",
                        )
                    )
                sink.event.set()
            while sink.inflight:  # the stream ends after the last accepted request finished
                await asyncio.wait(set(sink.inflight))
        finally:
            sink.client_done = True
            sink.event.set()

    def _abort_in_session(
        self, tr: Tracked, abort: pb.SessionRequest.Abort, sink: SessionSink
    ) -> None:
        try:
            reason, message = _abort_reason(abort.reason)
        except InvalidRequest as exc:
            code, text = status_for(exc)
            sink.errors.append(
                pb.SessionResponse.Error(
                    request_id=abort.request_id, code=code.value[0], message=text
                )
            )
            return
        self.requests.abort_tracked(tr, message, reason)

    def _submit(
        self,
        submit: pb.SessionRequest.Submit,
        sink: SessionSink,
        owner: str,
        limit: int,
        carrier: dict[str, str],
    ) -> None:
        """One Session submit, without awaiting: the request is queued now; with the journal,
        held and told `accepted` (or its refusal) from the journal's acknowledgement."""
        try:
            if len(sink.open) + len(sink.held) >= limit:
                raise_limit(limit)
            tr = self.acceptor.submit(
                submit.request, sink, owner=owner, client_tag=submit.client_tag, carrier=carrier
            )
        except KvschedError as exc:
            self._submit_refused(submit, sink, exc, carrier)
            return
        if not self.durable.journals(tr):  # on a peer's instance: that daemon journals it
            cluster = self.requests.cluster
            if type(tr.location) is not RemotePeer or cluster is None:
                self._announce(sink, tr)
                return
            # Told `accepted` only once the peer accepted (journaled) it, as a Generate is told
            # `queued` (Acceptor.accept): its outputs are held until then.
            sink.hold(tr)
            wait = asyncio.ensure_future(cluster.forward_confirmed(tr))
            sink.inflight.add(wait)

            def forwarded(w: asyncio.Future[None]) -> None:
                sink.inflight.discard(w)
                self._announce(sink, tr)

            wait.add_done_callback(forwarded)
            return
        sink.hold(tr)
        write = self.durable.begin_confirm(tr, submit.request)  # a refusal aborts it first
        sink.inflight.add(write)

        def confirmed(w: asyncio.Future[None]) -> None:
            sink.inflight.discard(w)
            exc = w.exception() if not w.cancelled() else Unavailable("journal write cancelled")
            if exc is None:
                self._announce(sink, tr)
                return
            sink.release(tr)
            if isinstance(exc, KvschedError):
                self._submit_refused(submit, sink, exc, carrier)
            else:
                log.error("journal write of %s failed: %r", tr.req.req_id, exc)

        write.add_done_callback(confirmed)

    def _submit_refused(
        self,
        submit: pb.SessionRequest.Submit,
        sink: SessionSink,
        exc: KvschedError,
        carrier: dict[str, str],
    ) -> None:
        self._refused(submit.request, exc, carrier)
        code, message = status_for(exc)
        sink.errors.append(
            pb.SessionResponse.Error(
                client_tag=submit.client_tag,
                request_id=submit.request.request_id,
                code=code.value[0],
                message=message,
            )
        )
        sink.event.set()

    def _announce(self, sink: SessionSink, tr: Tracked) -> None:
        sink.announce(tr)
        if sink.closed and not tr.detachable and not tr.finished:
            self.requests.abort_tracked(tr, sink_close_reason(sink))

    def _batch(self, sink: SessionSink) -> pb.SessionResponse | None:
        """Everything new on this session since its last message, in one message: requests
        accepted, their new tokens (each request once), requests finished, errors."""
        accepted, sink.accepted = sink.accepted, []
        chunks, sink.chunks = sink.chunks, []
        dirty, sink.dirty = sink.dirty, {}
        errors, sink.errors = sink.errors, []
        if not (accepted or chunks or dirty or errors):
            return None
        msg = pb.SessionResponse()
        if accepted:
            acc = msg.accepted
            acc.request_ids.extend([tr.req.req_id for tr in accepted])
            acc.client_tags.extend([tr.client_tag for tr in accepted])
            acc.instances.extend([tr.instance_id for tr in accepted])
        if chunks:
            ids, counts, tokens = _token_columns(chunks, sink)
            out = msg.tokens
            out.request_ids.extend(ids)
            out.num_tokens.extend(counts)
            out.token_ids.extend(tokens)
            if sink.logprob_pos:  # only sessions with requests that asked
                fill_delta_logprobs(out, sink, sink.open)
        for rid, tr in dirty.items():
            if rid not in sink.open:
                continue  # never announced (refused by the journal), or already closed
            if tr.sink is not sink:
                sink.open.pop(rid, None)  # resumed on its own stream: it left this session
                sink.logprob_pos.pop(rid, None)
            elif tr.finished:
                msg.finished.append(codec.finished_to_proto(tr.req))
                sink.open.pop(rid, None)
                sink.logprob_pos.pop(rid, None)
        if errors:
            msg.errors.extend(errors)
        return msg


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call had a deadline and it has passed."""
    left = context.time_remaining()
    return left is not None and left <= 0
