"""Routing at overload (issue 25): a request goes only where its predicted wait meets its
deadline; when no instance can, it is demoted (or refused with a retry hint); the predicted
wait is calibrated against the measured TTFT of the requests placed."""

from __future__ import annotations

import pytest

from kvsched.core import Scheduler
from kvsched.core.errors import CapacityExceeded
from kvsched.core.router import Router, WaitCalibration, predicted_wait_ms
from tests.core.factories import make_request, make_scheduler, step

PREFIX = list(range(5000, 5000 + 64))  # 4 blocks of 16


def busy(s: Scheduler, n: int) -> None:
    """Queue n long prompts on s (nothing runs: they stay queued)."""
    for _ in range(n):
        s.add_request(make_request(2000, max_tokens=4))


def warm(s: Scheduler) -> None:
    """Cache PREFIX on s."""
    req = make_request(PREFIX + [1, 2], max_tokens=1)
    s.add_request(req)
    for _ in range(20):
        if req.is_finished:
            break
        step(s)
    assert s.prefix_hit_tokens(make_request(PREFIX + [9], max_tokens=1)) == 64


def test_a_prefix_is_not_followed_onto_an_instance_that_misses_the_deadline() -> None:
    a, b = make_scheduler(instance_id="a"), make_scheduler(instance_id="b")
    warm(a)
    req = make_request(PREFIX + [7, 8], max_tokens=2)
    assert Router(ttft_target_ms=1e9).pick([a, b], req) == 0  # the prefix wins below capacity
    busy(a, 8)
    wait_a = predicted_wait_ms(a, make_request(PREFIX + [7, 8]), 64)
    wait_b = predicted_wait_ms(b, make_request(PREFIX + [7, 8]), 0)
    assert wait_b < wait_a
    target = (wait_a + wait_b) / 2  # a cannot make it, b can
    req = make_request(PREFIX + [7, 8], max_tokens=2)
    assert Router(ttft_target_ms=target).pick([a, b], req) == 1
    assert not req.demoted
    # The old rule (overload "off") follows the prefix onto the instance that misses it.
    off = Router(ttft_target_ms=target, overload="off")
    assert off.pick([a, b], make_request(PREFIX + [7, 8], max_tokens=2)) == 0


def test_overflow_is_demoted_on_the_soonest_instance_or_refused_with_a_retry_hint() -> None:
    a, b = make_scheduler(instance_id="a"), make_scheduler(instance_id="b")
    busy(a, 6)
    busy(b, 3)
    router = Router(ttft_target_ms=1.0)  # nobody can
    req = make_request(500, max_tokens=2)
    assert router.pick([a, b], req) == 1  # b is predicted to reach it first
    assert req.demoted and router.num_overflowed == 1
    b.add_request(req)  # queued behind every request that can still make its deadline
    assert b.waiting.ms_ahead(make_request(10)) < b.waiting.ms_ahead(req)
    with pytest.raises(CapacityExceeded, match="retry in"):
        Router(ttft_target_ms=1.0, overload="refuse").pick([a, b], make_request(500))
    # A deadline of the request's own is what it is placed to meet.
    late = make_request(500, max_tokens=2, ttft_deadline_ms=1e9)
    assert Router(ttft_target_ms=1.0, overload="refuse").pick([a, b], late) == 1  # less load
    assert not late.demoted


def test_calibration_learns_measured_over_predicted_ttft() -> None:
    cal = WaitCalibration(alpha=0.5, check_per_pick=8)
    reqs = [make_request(10, arrival_time=0.0) for _ in range(4)]
    for r in reqs:
        cal.placed(r, 1000.0)  # predicted 1 s each
    cal.update()
    assert cal.factor == 1.0  # no first token yet: nothing learned, nothing dropped
    for r in reqs:
        r.first_token_time = 1.5  # measured 1.5 s
    for _ in range(3):
        cal.update()
    assert cal.num_measured == 4
    assert 1.4 < cal.factor <= 1.5
    with pytest.raises(ValueError, match="overload"):
        Router(overload="sometimes")
