"""`RequestTable.place_parked` keeps every request parked while it walks the parked list.

The walk can finish a request (its deadline passed, or its new instance refused it), and a
finish tells the observers, which may lose an instance: `InstanceEngine.take_out` parks each of
its requests (`requeue_lost`), and each park runs a walk of its own. A request parked then must
still be in the parked list afterwards (placed later, or failed at its deadline): one that is
tracked but not in the list would never be placed nor finished, and its client would wait
forever. Through the real daemon (in process, real sim workers over gRPC on loopback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import grpc

from kvsched.server.requests.record import Parked, Tracked
from kvsched.server.requests.resume import ParkedSink
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import common_pb2
from tests.server.telemetry_harness import request, running_daemon


class LoseInstancesOnFinish:
    """A lifecycle observer that, when `trigger` finishes, takes out the instances holding
    `victims` (as a worker that broke the protocol would be), from inside the finish."""

    def __init__(self, trigger: str, victims: set[str], table: RequestTable) -> None:
        self.trigger, self.victims, self.table = trigger, victims, table
        self.lost: list[str] = []

    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        pass

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        pass

    def request_progressed(self, tr: Tracked, /) -> None:
        pass

    def request_finished(self, tr: Tracked, /) -> None:
        if tr.req.req_id != self.trigger:
            return
        for rid in sorted(self.victims):
            eng = self.table.tracked[rid].engine
            if eng is not None and eng.ready:
                self.lost.append(eng.instance_id)
                eng.take_out("test: lost while a parked request finished")


def test_requests_parked_during_the_walk_are_kept() -> None:
    async def go() -> None:
        async with running_daemon({}, zero_cost=False, instances=("i0", "i1")) as h:
            table = h.daemon.requests
            calls = {
                rid: h.stub.Generate(request(rid, 16, 4000, seed=n))
                for n, rid in enumerate(("a", "b", "c"))
            }
            deadline = time.monotonic() + 20
            while not all(
                (tr := table.tracked.get(rid)) is not None and tr.engine is not None
                for rid in calls
            ):
                assert time.monotonic() < deadline, "the requests were never placed"
                await asyncio.sleep(0.01)
            # No await from here on: nothing else runs until the assertions.
            for eng in h.daemon.registry.engines.values():
                eng.drain()  # no instance takes a parked request: they stay parked
            # "a" parked with its deadline passed: the next walk finishes it.
            a = table.tracked["a"]
            old_sink = table.set_aside(a, ParkedSink())
            assert table.take_back(a, time.monotonic() - 1.0, "test: out of time")
            table.redirect(a, old_sink)
            observer = LoseInstancesOnFinish("a", {"b", "c"}, table)
            table.observers.observe(observer)
            table.place_parked()
            assert observer.lost  # the finish of "a" lost the instances of "b" and "c"
            assert "a" not in table.tracked
            for rid in ("b", "c"):
                tr = table.tracked[rid]
                assert type(tr.location) is Parked
                assert tr in table.parked, f"{rid} is parked but dropped from the parked list"
            assert len(table.parked) == len({id(tr) for tr in table.parked})
            # Each ends with exactly one Finished its client is told of.
            table.abort_all("test over")
            for rid, call in calls.items():
                reasons = []
                while (r := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                    if r.WhichOneof("kind") == "finished":
                        reasons.append(r.finished.reason)
                want = common_pb2.FINISH_REASON_ERROR if rid == "a" else None
                assert len(reasons) == 1 and (want is None or reasons == [want]), (rid, reasons)
            assert not table.tracked

    asyncio.run(go())
