"""The sinks of RequestService's streams: what a Generate stream or a Session stream has
to send next. Sinks never queue tokens: the tokens live in the core request, and a sink only
remembers which requests have something new, so a slow reader gets larger batches, not a
growing buffer.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np

from kvsched.codec.common import logprobs_to_proto
from kvsched.core.logprobs import TokenLogprobs
from kvsched.core.request import Request
from kvsched.server.requests.record import Tracked
from kvsched.v1 import request_service_pb2 as pb


class StreamSink:
    """One Generate stream. `pending_since` is when it last had news its client has not
    been sent; the daemon's watchdog cuts streams that stall past stall_timeout_s. It keeps
    no tokens: the stream sends its request's `output_token_ids` past `sent` (the output
    tokens it has handed its client; a Resume's stream starts at the caller's count)."""

    __slots__ = ("event", "moved", "pending_since", "sent", "stalled", "task")
    # The engine's token values are not needed: the stream reads them off the request.
    wants_tokens = False

    def __init__(self, sent: int = 0) -> None:
        self.sent = sent
        self.event = asyncio.Event()
        self.pending_since: float | None = None
        self.stalled = False
        self.task = asyncio.current_task()
        # Set when the request was taken from this stream to be resumed elsewhere (a fenced
        # daemon parks it): the stream ends with UNAVAILABLE and this message.
        self.moved = ""

    def notify(self, tr: Tracked) -> None:
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.event.set()

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        """News only: the tokens are in the request already (see the `Sink` contract)."""
        self.notify(trs[0])

    async def wait(self) -> None:
        """Until there is news; its client is then no longer owed any."""
        await self.event.wait()
        self.event.clear()
        self.pending_since = None

    def take(self, tr: Tracked) -> tuple[list[int], bool]:
        """The news since the last take: the output tokens past `sent`, and whether the request
        had finished, decided at the same instant (more may arrive while the stream's yield is
        suspended). The token's way to the client: the engine hands its step's tokens to the
        request (core/slots.py) and tells this sink (news only, `add_tokens`); this read pulls
        them, one slice per wake-up however many steps ran since (coalesced when the client
        falls behind). Reading a placed request's `output_token_ids` moves the tokens waiting
        in its slot's ring into its list (`SlotTable.sync`): a core write, made here on the
        event loop between two engine steps, kept for speed (the decode hot path writes only
        numpy columns)."""
        finished = tr.finished
        out = tr.req.output_token_ids
        n, sent = len(out), self.sent
        if n <= sent:
            return [], finished
        self.sent = n
        return out[sent:n], finished

    def attached(self) -> bool:
        """Its Generate/Resume call is still open (the handler's task runs: a client that
        gave up waiting, or went away, cancelled it)."""
        return self.task is not None and not self.task.done()


class SessionSink:
    """One Session stream: what to put in its next batched response. Tokens arrive as the
    engine's deltas (`chunks`, in order); `dirty` holds requests that finished."""

    wants_tokens = True

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
        # outputs are held: nothing about them is sent before `accepted`), and the journal
        # writes of those records.
        self.held: dict[str, Tracked] = {}
        self.held_set: set[Tracked] = set()  # the same requests (a C-speed overlap test)
        self.inflight: set[asyncio.Future[None]] = set()
        # Requests that asked for log-probabilities: the output position of the next row this
        # stream sends (only they pay: `_batch` looks at this dict, usually empty).
        self.logprob_pos: dict[str, int] = {}

    async def wait(self) -> None:
        """Until there is news; its client is then no longer owed any."""
        await self.event.wait()
        self.event.clear()
        self.pending_since = None

    def notify(self, tr: Tracked) -> None:
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.dirty[tr.req.req_id] = tr
        self.event.set()

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        if self.held and not self.held_set.isdisjoint(trs):
            # Held requests' tokens stay in their requests; `announce` sends them all.
            if counts is None:
                # One row per request: the few held rows found and cut out at C speed (this
                # runs at most steps while requests turn over: a new one is held until its
                # record is stored).
                cut = sorted(trs.index(tr) for tr in self.held_set.intersection(trs))
                trs, toks = _without(trs, cut), _without(toks, cut)
            else:
                starts = list(itertools.accumulate(counts, initial=0))
                held = self.held_set
                rows = [i for i, tr in enumerate(trs) if tr not in held]
                toks = [t for i in rows for t in toks[starts[i] : starts[i + 1]]]
                trs, counts = [trs[i] for i in rows], [counts[i] for i in rows]
            if not trs:
                return
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.chunks.append((trs, counts, toks))
        self.event.set()

    def attached(self) -> bool:
        """Its Session stream is still open."""
        return not self.closed and (self.task is None or not self.task.done())

    def hold(self, tr: Tracked) -> None:
        """Hold `tr`'s outputs until its record is stored (`announce`) or refused
        (`release`)."""
        self.held[tr.req.req_id] = tr
        self.held_set.add(tr)

    def release(self, tr: Tracked) -> None:
        self.held.pop(tr.req.req_id, None)
        self.held_set.discard(tr)

    def announce(self, tr: Tracked) -> None:
        """`tr` is accepted (stored): tell it, with the tokens it made while held."""
        self.open[tr.req.req_id] = tr
        self.accepted.append(tr)
        if tr.req.logprobs is not None:
            self.logprob_pos[tr.req.req_id] = 0
        out = tr.req.output_token_ids
        if tr in self.held_set:
            self.release(tr)
            if out:
                self.chunks.append(([tr], [len(out)], list(out)))
            if tr.finished:
                self.dirty[tr.req.req_id] = tr
        if self.pending_since is None:
            self.pending_since = time.monotonic()
        self.event.set()


def _without(xs: list[Any], cut: list[int]) -> list[Any]:
    """`xs` without the items at the sorted indices `cut`."""
    out = xs[: cut[0]]
    for a, b in zip(cut, [*cut[1:], len(xs)], strict=True):
        out += xs[a + 1 : b]
    return out


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


def fill_logprobs(out: pb.GenerateResponse.Tokens, req: Request, start: int, n: int) -> None:
    """A Tokens message's log-probability rows: output tokens [start, start + n), and the
    prompt's rows with the message that starts at output position 0 (a request that asked)."""
    lp, sp = req.logprobs, req.sampling
    if lp is None:
        return
    if sp.logprobs is not None:
        logprobs_to_proto(TokenLogprobs.of(lp.rows(start, start + n)), out.logprobs)
    if start == 0 and sp.prompt_logprobs is not None and lp.prompt is not None:
        logprobs_to_proto(TokenLogprobs.of(lp.prompt), out.prompt_logprobs)


def fill_delta_logprobs(
    out: pb.SessionResponse.TokenDeltas, sink: SessionSink, open_reqs: dict[str, Tracked]
) -> None:
    """A Session message's log-probability columns, for the requests in it that asked
    (`sink.logprob_pos`): each one's rows of the tokens in this message, its prompt's rows with
    its first tokens; 0 rows for the others."""
    pos = sink.logprob_pos
    if pos.keys().isdisjoint(out.request_ids):
        return
    rows, prompt = TokenLogprobs(), TokenLogprobs()
    num_rows, num_prompt = [], []
    for rid, n in zip(out.request_ids, out.num_tokens, strict=True):
        start = pos.get(rid)
        tr = open_reqs.get(rid)
        lp = tr.req.logprobs if tr is not None and start is not None else None
        if lp is None or start is None or tr is None:
            num_rows.append(0)
            num_prompt.append(0)
            continue
        sp = tr.req.sampling
        got = lp.rows(start, start + n) if sp.logprobs is not None else []
        rows.extend(got)
        num_rows.append(len(got))
        first = lp.prompt if start == 0 and sp.prompt_logprobs is not None else None
        prompt.extend(first or [])
        num_prompt.append(len(first or []))
        pos[rid] = start + n
    out.num_logprobs.extend(num_rows)
    logprobs_to_proto(rows, out.logprobs)
    out.num_prompt_logprobs.extend(num_prompt)
    logprobs_to_proto(prompt, out.prompt_logprobs)


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
