"""A host or storage hit is worth the recompute it saves less its transfer, everywhere a hit is
counted by the router (issue 37): its hit score and its predicted wait (the SLO-aware
placement at overload). A queued request's predicted prefill (`queued_ms`, the instance's
load) keeps the raw hit count: pricing it measured worse (BENCHMARKS 17)."""

from __future__ import annotations

import pytest

from kvsched.core import Router, Scheduler
from kvsched.core.errors import CapacityExceeded
from tests.core.factories import make_config, make_request
from tests.core.test_host_tier import BS, A, host_hashes, run_to_end


def with_host_hit(swap_block_ms: float) -> tuple[Scheduler, list[int]]:
    """A scheduler whose host tier (not its GPU pool) holds A's 3 blocks, and a prompt that
    continues A."""
    cfg = make_config(
        block_size=BS,
        num_gpu_blocks=8,
        num_host_blocks=16,
        host_write_policy="write_back",
        prealloc_threshold=0,
        prealloc_blocks=1,
    )
    cfg.step_cost.per_swapped_block_ms = swap_block_ms
    s = Scheduler(cfg)
    run_to_end(s, make_request(A + [1], max_tokens=1))
    run_to_end(s, make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1))
    assert s.kv.tier_hits(make_request(A + [2], max_tokens=1))[:2] == (0, 48)
    assert len(host_hashes(s)) >= 3
    return s, A + list(range(9000, 9010))


@pytest.mark.parametrize("swap_block_ms", [0.04, 1e3])
def test_the_routers_wait_prices_a_host_hit_by_its_swap_in(swap_block_ms: float) -> None:
    s, prompt = with_host_hit(swap_block_ms)
    req = make_request(prompt, max_tokens=2)
    worth, hit = s.priced_hit(req)
    assert hit == 48
    none, raw = s.predicted_wait_ms(req, 0), s.predicted_wait_ms(req, 48)
    assert none > raw
    router = Router(overload="demote", ttft_target_ms=1e9)
    assert router.pick([s], req) == 0
    (_, used), *_ = router.calibration._placed
    assert used == s.predicted_wait_ms(req, int(worth))
    if swap_block_ms >= 1e3:  # the copy costs more than recomputing: worth nothing
        assert worth == 0 and used == none
    else:  # cheaper than recompute, not free
        assert 0 < worth < 48 and raw < used <= none


def test_at_overload_a_hit_whose_transfer_costs_its_recompute_does_not_meet_a_deadline() -> None:
    s, prompt = with_host_hit(1e3)
    req = make_request(prompt, max_tokens=2)
    none, raw = s.predicted_wait_ms(req, 0), s.predicted_wait_ms(req, 48)
    # A target the raw hit count would meet and the priced one does not: refused.
    router = Router(overload="refuse", ttft_target_ms=(none + raw) / 2)
    with pytest.raises(CapacityExceeded):
        router.pick([s], req)
