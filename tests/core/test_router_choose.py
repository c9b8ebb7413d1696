"""The one placement rule over plain candidates (`core.router.choose`): numbers in, a
`Choice` value out, nothing sent. `Router.pick` (this daemon's instances) and the cluster's
router (local and peer instances alike) both decide by it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from kvsched.core.errors import CapacityExceeded
from kvsched.core.request import Request
from kvsched.core.router import Choice, Router, choose
from tests.core.factories import make_request


def test_prefix_first_then_load() -> None:
    # a holds half the prompt; b holds nothing and is idle.
    assert choose([0.5, 0.0], [10.0, 10.0], [0.4, 0.0], 1e9, "demote", 0.5) == Choice(0, False)
    # a is far busier than b: the load term outweighs the hit.
    assert choose([0.5, 0.0], [10.0, 10.0], [2.0, 0.0], 1e9, "demote", 0.5) == Choice(1, False)
    # first wins ties
    assert choose([0.0, 0.0], [1.0, 1.0], [0.1, 0.1], 1e9, "demote", 0.5) == Choice(0, False)


def test_only_candidates_in_time_are_scored() -> None:
    # a has the prefix but misses the deadline: b, in time, is chosen.
    assert choose([0.9, 0.0], [900.0, 50.0], [0.0, 0.0], 100.0, "demote", 0.5) == Choice(1, False)
    # overload "off": the deadline is not looked at.
    assert choose([0.9, 0.0], [900.0, 50.0], [0.0, 0.0], 100.0, "off", 0.5) == Choice(0, False)


def test_overflow_goes_to_the_soonest_or_to_the_best_score() -> None:
    hits, waits, loads = [0.9, 0.0, 0.0], [900.0, 500.0, 700.0], [0.0, 0.5, 0.0]
    assert choose(hits, waits, loads, 100.0, "demote", 0.5) == Choice(1, True)
    got = choose(hits, waits, loads, 100.0, "demote", 0.5, soonest_on_overflow=False)
    assert got == Choice(0, True)


def test_ineligible_candidates_are_never_chosen() -> None:
    mask = np.array([False, True, True])
    got = choose([1.0, 0.0, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], 1e9, "demote", 0.5, mask)
    assert got == Choice(2, False)
    over = choose([1.0, 0.0, 0.1], [9e9, 5.0, 7.0], [0.0, 0.0, 0.0], 1.0, "demote", 0.5, mask)
    assert over == Choice(1, True)


@dataclass
class Numbers:
    """A candidate known only by its numbers (what a peer's published facts give)."""

    hit: float
    wait: float
    backlog_ms: float
    paused: bool = False
    is_decode: bool = False
    block_size: int = 16

    def prefix_hit_tokens(self, req: Request) -> int:
        return int(self.hit)

    def load_facts(self) -> dict[str, float]:
        return {"predicted_backlog_ms": self.backlog_ms, "kv_usage": 0.0}

    def priced_hit(self, req: Request) -> tuple[float, int]:
        return self.hit, int(self.hit)

    def predicted_wait_ms(self, req: Request, hit_tokens: int) -> float:
        return self.wait


@pytest.mark.parametrize("overload", ["demote", "refuse", "off"])
def test_router_pick_is_choose_over_its_candidates_numbers(overload: str) -> None:
    """Router.pick decides by `choose` alone: over random candidates, its pick is choose's
    over their numbers (hit fraction, calibrated wait, instance_load), and it demotes or
    refuses exactly when choose says the request overflowed."""
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 6)
        cands = [
            Numbers(float(rng.randint(0, 64)), rng.uniform(0, 400), rng.uniform(0, 6000))
            for _ in range(n)
        ]
        router = Router(load_weight=0.5, load_seconds=3.0, ttft_target_ms=200.0, overload=overload)
        req = make_request(64, max_tokens=2)
        loads = [router.load(c) for c in cands]
        want = choose(
            [c.hit / 64 for c in cands], [c.wait for c in cands], loads, 200.0, overload, 0.5
        )
        if want.overflowed and overload == "refuse":
            with pytest.raises(CapacityExceeded):
                router.pick(cands, req)
            continue
        assert router.pick(cands, req) == want.index
        assert req.demoted == (want.overflowed and overload == "demote")
