"""bench.send_cost's reading of a replay: a request's place in its burst, the median send by
place (places from 12 on together) and the slope of send on the place (the cost each request
adds to the ones behind it)."""

from __future__ import annotations

import math

from bench.send_cost import by_place, places, slope_ms
from kvsched.traces import TraceRequest


def _reqs(arrivals: list[float]) -> list[TraceRequest]:
    return [TraceRequest(a, [1, 2, 3], 4) for a in arrivals]


def test_places_count_within_each_instant() -> None:
    assert places(_reqs([0, 0, 0, 3, 3, 6])) == [1, 2, 3, 1, 2, 1]


def test_a_fixed_cost_a_request_is_the_slope_and_the_medians_climb_by_it() -> None:
    reqs = _reqs([0.0] * 14 + [3.0] * 3)
    sends: list[float | None] = [0.001 + 0.004 * (p - 1) for p in places(reqs)]
    assert math.isclose(slope_ms(reqs, sends), 4.0)
    got = by_place(reqs, sends)
    assert got["1"] == 1.0 and got["2"] == 5.0 and got["11"] == 41.0
    assert got["12"] == 49.0  # places 12-14 together: 45, 49, 53 ms
    sends[0] = None  # a request without a span is left out
    assert by_place(reqs, sends)["1"] == 1.0 and math.isclose(slope_ms(reqs, sends), 4.0)
