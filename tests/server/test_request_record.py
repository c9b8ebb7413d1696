"""A request's record and its lifecycle, through the real daemon (in process, real sim
workers over gRPC on loopback): observers subscribed to the request table are told accepted,
moved and finished, each once and in that order; the record's location is a tagged value
that follows the request (on an engine, parked after its instance is lost, on the next
engine), and its one Finished reaches both the client and the observers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import grpc

from kvsched.server.requests.record import LocalEngine, Parked, Tracked
from kvsched.v1 import common_pb2
from tests.server.telemetry_harness import Result, request, running_daemon


class Recorder:
    """A lifecycle observer that writes down what it is told and where the request was."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []  # (event, request id, instance)
        self.kinds: list[type] = []  # the record's location type at each event

    def _note(self, event: str, tr: Tracked) -> None:
        self.seen.append((event, tr.req.req_id, tr.instance_id))
        self.kinds.append(type(tr.location))

    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        self._note("accepted", tr)

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        self._note("moved", tr)

    def request_progressed(self, tr: Tracked, /) -> None:
        self._note("progressed", tr)

    def request_finished(self, tr: Tracked, /) -> None:
        self._note("finished", tr)


def test_observers_see_accepted_moved_finished_once_each() -> None:
    rec = Recorder()
    parked: list[Any] = []

    async def go() -> tuple[Result, str]:
        async with running_daemon({}, zero_cost=False, instances=("i0", "i1")) as h:
            table = h.daemon.requests
            table.observers.observe(rec)
            call = h.stub.Generate(request("mv", 16, 200))
            out, first = Result(), ""
            while (r := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                kind = r.WhichOneof("kind")
                if kind == "queued":
                    first = r.queued.instance
                elif kind == "tokens":
                    if not out.tokens:
                        await h.stop_worker(first)  # lose the instance mid-stream
                        tr = table.tracked.get("mv")
                        parked.append(None if tr is None else tr.location)
                    out.tokens.extend(r.tokens.token_ids)
                elif kind == "finished":
                    out.finished = r.finished
            assert "mv" not in table.tracked and not table.parked
            return out, first

    result, first = asyncio.run(go())
    other = "i1" if first == "i0" else "i0"
    assert result.finished is not None
    assert result.finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert len(result.tokens) == 200
    assert rec.seen == [
        ("accepted", "mv", first),
        ("moved", "mv", first),  # told before it is parked: it names the instance it lost
        ("finished", "mv", other),
    ]
    assert rec.kinds == [LocalEngine, LocalEngine, LocalEngine]
    # Right after the loss it was either still parked (no instance yet) or already placed on
    # the other instance; never on the lost one.
    (loc,) = parked
    assert isinstance(loc, Parked | LocalEngine), loc
    if isinstance(loc, LocalEngine):
        assert loc.engine.instance_id == other
    else:
        assert "lost" in loc.reason


def test_an_abort_of_a_queued_request_finishes_it_once() -> None:
    """An abort ends a request through the one finish: the observers hear finished once, the
    client gets one Finished (ABORT), and a second abort is a no-op."""
    rec = Recorder()

    async def go() -> Result:
        async with running_daemon({}, zero_cost=False) as h:
            table = h.daemon.requests
            table.observers.observe(rec)
            call = h.stub.Generate(request("ab", 16, 100_000))
            out = Result()
            while (r := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                kind = r.WhichOneof("kind")
                if kind == "tokens":
                    if not out.tokens:
                        table.abort("ab")
                        table.abort("ab")  # finished (or finishing): no error, no second end
                    out.tokens.extend(r.tokens.token_ids)
                elif kind == "finished":
                    out.finished = r.finished
            return out

    result = asyncio.run(go())
    assert result.finished is not None
    assert result.finished.reason == common_pb2.FINISH_REASON_ABORT
    assert [e for e, _, _ in rec.seen] == ["accepted", "finished"]
