"""RequestService: Generate (one request per stream), Abort, Session (many per stream).

Sinks never queue tokens: the tokens live in the core request, and a sink only remembers which
requests have something new. A slow reader therefore gets larger batches, not a growing buffer,
and a Session's memory is bounded by its open requests.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from kvsched import codec
from kvsched.core import KvschedError, RequestNotFound
from kvsched.server.auth import current_principal
from kvsched.server.durable import Durability, OwnedElsewhere
from kvsched.server.errors import status_for
from kvsched.server.request_table import Tracked
from kvsched.v1 import request_service_pb2 as pb
from kvsched.v1 import request_service_pb2_grpc

log = logging.getLogger("kvsched.frontend")


class StreamSink:
    """One Generate stream. `pending_since` is when it last had news its client has not
    been sent; the daemon's watchdog cuts streams that stall past stall_timeout_s. It keeps
    no tokens: the stream sends its request's `output_token_ids` past `Tracked.sent`."""

    __slots__ = ("event", "pending_since", "stalled", "task")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.pending_since: float | None = None
        self.stalled = False
        self.task = asyncio.current_task()

    def notify(self, tr: Tracked) -> None:
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.event.set()

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        """News only: the tokens are in the request already (see the `Sink` contract)."""
        self.notify(trs[0])


class SessionSink:
    """One Session stream: what to put in its next batched response. Tokens arrive as the
    engine's deltas (`chunks`, in order); `dirty` holds requests that finished."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.pending_since: float | None = None
        self.stalled = False
        self.task = asyncio.current_task()
        self.dirty: dict[str, Tracked] = {}
        self.chunks: list[tuple[list[Tracked], list[int] | None, list[int]]] = []
        # The request ids of the last columnar delta's `trs` list (the engine hands the same
        # list step after step while its batch is steady): (that list, its ids).
        self.ids_of: tuple[list[Tracked], list[str]] | None = None
        self.accepted: list[Tracked] = []
        self.errors: list[pb.SessionResponse.Error] = []
        self.open: dict[str, Tracked] = {}
        self.client_done = False
        self.closed = False  # the stream ended
        # Journal on: accepted requests whose record the journal has not stored yet (their
        # outputs are held: nothing about them is sent before `accepted`), and the tasks
        # waiting for those records.
        self.held: dict[str, Tracked] = {}
        self.held_set: set[Tracked] = set()  # the same requests (a C-speed overlap test)
        self.inflight: set[asyncio.Task[None]] = set()

    def notify(self, tr: Tracked) -> None:
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.dirty[tr.req.req_id] = tr
        self.event.set()

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        if self.held and not self.held_set.isdisjoint(trs):
            # Held requests' tokens stay in their requests; `announce` sends them all.
            if counts is None:
                keep = [i for i, tr in enumerate(trs) if not tr.held]
                trs, toks = [trs[i] for i in keep], [toks[i] for i in keep]
            else:
                starts = list(itertools.accumulate(counts, initial=0))
                rows = [i for i, tr in enumerate(trs) if not tr.held]
                toks = [t for i in rows for t in toks[starts[i] : starts[i + 1]]]
                trs, counts = [trs[i] for i in rows], [counts[i] for i in rows]
            if not trs:
                return
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.chunks.append((trs, counts, toks))
        self.event.set()

    def announce(self, tr: Tracked) -> None:
        """`tr` is accepted (stored): tell it, with the tokens it made while held."""
        self.open[tr.req.req_id] = tr
        self.accepted.append(tr)
        out = tr.req.output_token_ids
        if tr.held:
            tr.held = False
            self.held.pop(tr.req.req_id, None)
            self.held_set.discard(tr)
            if out:
                self.chunks.append(([tr], [len(out)], list(out)))
            if tr.finished:
                self.dirty[tr.req.req_id] = tr
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.event.set()


def metadata(context: Any) -> dict[str, str]:
    """The call's metadata as a dict (trace context travels here)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def principal(context: Any) -> str:
    """The authenticated caller, as set by the auth interceptor ('' without auth)."""
    return current_principal.get()


class RequestServicer(request_service_pb2_grpc.RequestServiceServicer):
    """Accepts requests into the request table and streams their outputs back."""

    def __init__(self, durable: Durability, max_session_requests: int) -> None:
        self.durable = durable
        self.requests = durable.table
        self.max_session_requests = max_session_requests

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        sink = StreamSink()
        tr = await self.durable.submit(
            request,
            sink,
            owner=principal(context),
            carrier=metadata(context),
            deadline_s=context.time_remaining(),
        )
        async for msg in self._follow(tr, sink, pb.GenerateResponse):
            yield msg

    async def Resume(
        self, request: pb.RequestServiceResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RequestServiceResumeResponse]:
        sink = StreamSink()
        carrier, node = metadata(context), self.requests.cluster
        owner = principal(context) if node is None else node.caller_of(carrier, principal(context))
        try:
            got = await self.durable.resume(request, owner, sink)
        except OwnedElsewhere as exc:
            if node is None:
                raise
            try:  # another daemon owns it: relay its stream (see ClusterNode.resume_at)
                async for out in node.resume_at(exc.daemon_id, request, owner, carrier):
                    yield out
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            return
        if isinstance(got, Tracked):
            async for msg in self._follow(got, sink, pb.RequestServiceResumeResponse):
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

    async def _follow(self, tr: Tracked, sink: StreamSink, kind: Any) -> AsyncIterator[Any]:
        """A request's stream: queued, its tokens past `tr.sent`, its one finished. Ends
        quietly when a Resume took the request over (`tr.sink` is another sink)."""
        done = False
        self.requests.streams.add(sink)
        try:
            yield kind(
                queued=pb.GenerateResponse.Queued(
                    request_id=tr.req.req_id, instance=tr.engine.instance_id
                )
            )
            while True:
                await sink.event.wait()
                sink.event.clear()
                sink.pending_since = None
                if tr.sink is not sink:
                    done = True  # resumed elsewhere: one request streams to one place
                    return
                req = tr.req
                # Decide "finished" and take the tokens at the same instant: more may arrive
                # while a yield is suspended.
                finished = tr.finished
                out = req.output_token_ids
                n = len(out)
                if n > tr.sent:
                    delta = out[tr.sent : n]
                    tr.sent = n
                    yield kind(tokens=pb.GenerateResponse.Tokens(token_ids=delta))
                if finished:
                    done = True
                    yield kind(finished=codec.finished_to_proto(req))
                    return
        finally:
            self.requests.streams.discard(sink)
            if not done and not tr.detachable and tr.sink is sink:
                self.requests.abort_tracked(tr, sink_close_reason(sink))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        owner = principal(context) or None
        try:
            self.requests.abort(request.request_id, owner=owner)
        except RequestNotFound:
            cluster = self.requests.cluster
            if cluster is None or not await cluster.abort_elsewhere(request.request_id, owner):
                raise
        return pb.AbortResponse()

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.SessionResponse]:
        sink = SessionSink()
        owner = principal(context)
        carrier = metadata(context)
        reader = asyncio.get_running_loop().create_task(
            self._read_session(request_iterator, sink, owner, carrier)
        )
        self.requests.streams.add(sink)
        try:
            while True:
                await sink.event.wait()
                sink.event.clear()
                sink.pending_since = None
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
        loop = asyncio.get_running_loop()
        journal = self.durable.journal is not None
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "submit" and journal:
                    # Submits wait for the journal concurrently: one round trip each, overlapped.
                    task = loop.create_task(self._submit(msg.submit, sink, owner, limit, carrier))
                    sink.inflight.add(task)
                    task.add_done_callback(sink.inflight.discard)
                elif kind == "submit":
                    await self._submit(msg.submit, sink, owner, limit, carrier)
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
                        self.requests.abort_tracked(tr, "aborted by client")
                else:
                    sink.errors.append(
                        pb.SessionResponse.Error(
                            code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            message="SessionRequest must set `submit` or `abort`",
                        )
                    )
                sink.event.set()
            while sink.inflight:  # the stream ends after the last accepted request finished
                await asyncio.wait(set(sink.inflight))
        finally:
            sink.client_done = True
            sink.event.set()

    async def _submit(
        self,
        submit: pb.SessionRequest.Submit,
        sink: SessionSink,
        owner: str,
        limit: int,
        carrier: dict[str, str],
    ) -> None:
        tag = submit.client_tag
        try:
            if len(sink.open) + len(sink.held) >= limit:
                raise_limit(limit)
            tr = self.requests.submit(
                submit.request, sink, owner=owner, client_tag=tag, carrier=carrier
            )
            if self.durable.journals(tr):
                tr.held = True
                sink.held[tr.req.req_id] = tr
                sink.held_set.add(tr)
                try:
                    await self.durable.confirm(tr, submit.request)
                except KvschedError:
                    tr.held = False
                    sink.held.pop(tr.req.req_id, None)
                    sink.held_set.discard(tr)
                    raise
        except KvschedError as exc:
            code, message = status_for(exc)
            sink.errors.append(
                pb.SessionResponse.Error(
                    client_tag=tag,
                    request_id=submit.request.request_id,
                    code=code.value[0],
                    message=message,
                )
            )
            sink.event.set()
            return
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
            acc.instances.extend([tr.engine.instance_id for tr in accepted])
        if chunks:
            ids, counts, tokens = _token_columns(chunks, sink)
            out = msg.tokens
            out.request_ids.extend(ids)
            out.num_tokens.extend(counts)
            out.token_ids.extend(tokens)
        for rid, tr in dirty.items():
            if rid not in sink.open:
                continue  # never announced (refused by the journal), or already closed
            if tr.sink is not sink:
                sink.open.pop(rid, None)  # resumed on its own stream: it left this session
            elif tr.finished:
                msg.finished.append(codec.finished_to_proto(tr.req))
                sink.open.pop(rid, None)
        if errors:
            msg.errors.extend(errors)
        return msg


def _token_columns(
    chunks: list[tuple[list[Tracked], list[int] | None, list[int]]],
    sink: SessionSink | None = None,
) -> tuple[list[str], list[int], list[int]]:
    """A session's token deltas as TokenDeltas columns, each request once, its tokens in
    order. One columnar delta (a steady step) is passed through as it is. With `sink`, the
    ids of a columnar delta's requests are kept there for the next message."""
    trs = chunks[0][0]
    if all(c[0] is trs and c[1] is None for c in chunks):
        # One columnar delta, or the rounds of a merged report over the same requests: each
        # request's tokens are one column of the (rounds x requests) table.
        known = sink.ids_of if sink is not None else None
        if known is not None and known[0] is trs:
            ids = known[1]
        else:
            ids = [tr.req.req_id for tr in trs]
            if sink is not None:
                sink.ids_of = (trs, ids)
        if len(chunks) == 1:
            return ids, [1] * len(trs), chunks[0][2]
        table = np.array([c[2] for c in chunks], dtype=np.int64)
        return ids, [len(chunks)] * len(trs), table.T.ravel().tolist()
    acc: dict[Tracked, list[int]] = {}
    for trs, counts, toks in chunks:
        if counts is None:
            for tr, t in zip(trs, toks, strict=True):
                have = acc.get(tr)
                if have is None:
                    acc[tr] = [t]
                else:
                    have.append(t)
            continue
        i = 0
        for tr, c in zip(trs, counts, strict=True):
            have = acc.get(tr)
            if have is None:
                acc[tr] = toks[i : i + c]
            else:
                have.extend(toks[i : i + c])
            i += c
    return (
        [tr.req.req_id for tr in acc],
        [len(v) for v in acc.values()],
        [t for v in acc.values() for t in v],
    )


def sink_close_reason(sink: StreamSink | SessionSink) -> str:
    if sink.stalled:
        return "client stopped reading its stream for stall_timeout_s: disconnected"
    return "client stream closed"


def raise_limit(limit: int) -> None:
    from kvsched.core import CapacityExceeded

    raise CapacityExceeded(
        f"this Session already has {limit} open requests (max_session_requests); "
        "wait for some to finish or open another stream"
    )
