"""Token deltas from the core to Session streams: grouped by sink, each request once per
message, every token once and in order."""

from __future__ import annotations

import asyncio

import numpy as np

from kvsched.core import Request
from kvsched.server.requests.delivery import TokenDelivery
from kvsched.server.requests.sinks import SessionSink, _token_columns
from kvsched.server.requests.table import Tracked


def tracked(req_id: str, sink: object) -> Tracked:
    req = Request(req_id, [1, 2, 3])
    tr = Tracked(req, None, sink)  # type: ignore[arg-type]
    req.tag = tr
    return tr


def test_one_columnar_delta_passes_through() -> None:
    a, b = tracked("a", None), tracked("b", None)
    assert _token_columns([([a, b], None, [7, 8])]) == (["a", "b"], [1, 1], [7, 8])


def test_deltas_of_several_reports_name_each_request_once_in_order() -> None:
    a, b, c = tracked("a", None), tracked("b", None), tracked("c", None)
    chunks = [
        ([a, b], None, [1, 2]),  # a decode step
        ([b], [2], [3, 4]),  # a row with two tokens (speculative decoding)
        ([a, c], None, [5, 6]),
    ]
    assert _token_columns(chunks) == (["a", "b", "c"], [2, 3, 1], [1, 5, 2, 3, 4, 6])


def test_token_delivery_splits_a_step_between_sessions_and_skips_untracked() -> None:
    async def go() -> None:
        s1, s2 = SessionSink(), SessionSink()
        a, b, c = tracked("a", s1), tracked("b", s2), tracked("c", s1)
        untracked = Request("u", [1])
        table = [a.req, untracked, b.req, c.req]  # the slot table's requests
        deltas = [
            (table, np.array([0, 1, 2, 3]), np.array([10, 11, 12, 13])),
            (b.req, None, [14, 15]),
        ]
        TokenDelivery()(deltas)
        assert _token_columns(s1.chunks) == (["a", "c"], [1, 1], [10, 13])
        assert _token_columns(s2.chunks) == (["b"], [3], [12, 14, 15])
        assert s1.event.is_set() and s1.pending_since is not None

    asyncio.run(go())


def test_rounds_of_a_merged_report_join_per_request() -> None:
    """The rounds of a merged report share one `trs` list (TokenDelivery looks them up once):
    each request still appears once, with its tokens in step order."""
    a, b = tracked("a", None), tracked("b", None)
    trs = [a, b]
    chunks = [(trs, None, [1, 2]), (trs, None, [3, 4]), (trs, None, [5, 6])]
    assert _token_columns(chunks) == (["a", "b"], [3, 3], [1, 3, 5, 2, 4, 6])  # type: ignore[arg-type]


def test_token_delivery_reuses_lookups_across_rounds_but_not_across_occupants() -> None:
    async def go() -> None:
        sink = SessionSink()
        a, b, c = tracked("a", sink), tracked("b", sink), tracked("c", sink)
        before = [a.req, b.req]
        after = [c.req, b.req]  # slot 0 changed hands between the rounds
        TokenDelivery()(
            [
                (before, np.array([0, 1]), np.array([1, 2])),
                (before, np.array([0, 1]), np.array([3, 4])),  # the core's same snapshot
                (after, np.array([0, 1]), np.array([5, 6])),
            ]
        )
        assert sink.chunks[0][0] is sink.chunks[1][0]
        assert sink.chunks[2][0] is not sink.chunks[0][0]
        assert _token_columns(sink.chunks) == (["a", "b", "c"], [2, 3, 1], [1, 3, 2, 4, 6, 5])

    asyncio.run(go())


def test_token_delivery_keeps_its_lookups_across_steps_until_the_rows_change() -> None:
    async def go() -> None:
        one, two = SessionSink(), SessionSink()
        a, b, c = tracked("a", one), tracked("b", two), tracked("c", one)
        snap = [a.req, b.req, c.req, None]  # slot 3 is empty
        deliver = TokenDelivery()
        deliver([(snap, np.array([0, 1, 2]), np.array([1, 2, 3]))])
        deliver([(snap, np.array([0, 1, 2]), np.array([4, 5, 6]))])  # the next step
        assert one.chunks[0][0] is one.chunks[1][0], "looked up once"
        assert _token_columns(one.chunks) == (["a", "c"], [2, 2], [1, 4, 3, 6])
        assert _token_columns(two.chunks) == (["b"], [2], [2, 5])
        # Other rows (c did not decode this step) on the same snapshot: looked up again.
        deliver([(snap, np.array([1, 0]), np.array([7, 8]))])
        assert _token_columns(one.chunks) == (["a", "c"], [3, 2], [1, 4, 8, 3, 6])
        assert _token_columns(two.chunks) == (["b"], [3], [2, 5, 7])

    asyncio.run(go())


def test_a_session_keeps_the_ids_of_a_steady_batch_and_redoes_them_when_it_changes() -> None:
    async def go() -> None:
        sink = SessionSink()
        a, b, c = tracked("a", sink), tracked("b", sink), tracked("c", sink)
        steady, other = [a, b], [c, b]
        first = _token_columns([(steady, None, [1, 2])], sink)
        again = _token_columns([(steady, None, [3, 4])], sink)
        assert first == (["a", "b"], [1, 1], [1, 2]) and again == (["a", "b"], [1, 1], [3, 4])
        assert again[0] is first[0], "the same requests: ids kept"
        assert _token_columns([(other, None, [5, 6])], sink) == (["c", "b"], [1, 1], [5, 6])

    asyncio.run(go())


def test_held_requests_rows_are_cut_out_of_a_step_until_announced() -> None:
    """Journal on: a request whose accepted record is not stored yet is held; its rows of a
    step (wherever they are: first, middle, last, adjacent) stay out of the stream, every
    other row keeps its token in order; `announce` then sends the held one's tokens."""

    async def go() -> None:
        sink = SessionSink()
        trs = [tracked(f"r{i}", sink) for i in range(8)]
        for i in (0, 3, 4, 7):
            sink.hold(trs[i])
        sink.add_tokens(trs, None, [100 + i for i in range(8)])
        assert _token_columns(sink.chunks) == (
            ["r1", "r2", "r5", "r6"],
            [1] * 4,
            [101, 102, 105, 106],
        )
        sink.chunks = []
        sink.release(trs[0])  # refused: dropped from the held set, nothing sent for it
        trs[3].req.output_token_ids.extend([103])
        sink.announce(trs[3])
        sink.add_tokens(trs, None, [200 + i for i in range(8)])
        ids, counts, toks = _token_columns(sink.chunks)
        assert ids == ["r3", "r0", "r1", "r2", "r5", "r6"]
        assert counts == [2, 1, 1, 1, 1, 1] and toks == [103, 203, 200, 201, 202, 205, 206]

    asyncio.run(go())
