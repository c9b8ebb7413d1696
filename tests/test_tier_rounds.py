"""bench.tier_rounds' split of the replay's extra TTFT: per request the parts add up to the
total (client + queue + service), send and deliver are taken from the replay's own columns,
and the send delay is grouped by a request's place among those arriving at the same instant."""

from __future__ import annotations

import math

import pytest

from bench.tier_rounds import gap, send_by_position
from kvsched.traces import TraceRequest


def test_the_parts_of_the_gap_add_up_to_the_total() -> None:
    sim = [
        {"ttft_s": 0.5, "queue_s": 0.0},
        {"ttft_s": 0.8, "queue_s": 0.1},
        {"ttft_s": None, "queue_s": None},  # not served by the sim: left out
    ]
    rep = [
        {"ttft_s": 0.56, "queue_s": 0.01, "daemon_ttft_s": 0.53, "send_s": 0.02,
         "client_late_s": 0.005, "deliver_s": 0.001},
        {"ttft_s": 0.95, "queue_s": 0.15, "daemon_ttft_s": 0.90, "send_s": float("nan"),
         "client_late_s": None, "deliver_s": 0.002},
        {"ttft_s": 1.0, "queue_s": 0.0, "daemon_ttft_s": 1.0},
    ]  # fmt: skip
    g = gap(sim, rep)
    assert g["requests"] == 2
    total, parts = g["total"]["mean"], ("client", "queue", "service")
    assert total == pytest.approx(sum(g[k]["mean"] for k in parts))
    assert total == pytest.approx(((0.56 - 0.5) + (0.95 - 0.8)) / 2)
    assert g["client"]["mean"] == pytest.approx((0.03 + 0.05) / 2)
    assert g["send"]["mean"] == pytest.approx(0.02), "a NaN send (no span) is left out"
    assert g["client_late"]["p50"] == pytest.approx(0.005)


def test_send_delay_is_grouped_by_place_in_a_burst() -> None:
    arrivals = [0.0, 0.0, 0.0, 3.0, 3.0, 6.0]
    reqs = [TraceRequest(a, [1, 2], 1) for a in arrivals]
    sends = [0.002, 0.007, 0.012, 0.003, 0.009, math.nan]
    by = send_by_position(reqs, [{"send_s": s} for s in sends])
    assert by == pytest.approx({"1": 2.5, "2": 8.0, "3": 12.0})
