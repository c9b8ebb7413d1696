"""A short seeded run of the nemesis suite (bench.chaos): a real nats-server, 3 daemons, 6 sim
workers, resumable clients; the four faults seed 23 draws (kill -9 of a daemon and its
restart, a daemon paused past the TTL, a daemon cut from its workers past the TTL, a daemon cut
from NATS past the TTL); then the checker's properties, one test each (the run is made once
for the module). KVSCHED_CHAOS_SEED picks another schedule."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.chaos.checker import table
from bench.chaos.main import Options, run
from bench.chaos.schedule import make_schedule

pytestmark = [pytest.mark.slow, pytest.mark.faults]  # ~100 s: `make test-faults` (a CI step)

SEED = int(os.environ.get("KVSCHED_CHAOS_SEED", "23"))
TTL_S = 2.0
DURATION_S = 36.0
KINDS = ("part_nats", "part_workers", "part_peers", "kill_daemon", "pause")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run_dir: Path = tmp_path_factory.mktemp("chaos")
    o = Options(
        seed=SEED,
        duration_s=DURATION_S,
        ttl_s=TTL_S,
        rate_per_s=2.0,
        max_in_flight=30,
        kinds=KINDS,
        drain_s=90.0,
        run_dir=str(run_dir),
    )
    r = run(o)
    print(table(r))  # `pytest -s`: the checker's table
    yield r


def prop(report: dict[str, Any], name: str) -> dict[str, Any]:
    p: dict[str, Any] = report["properties"][name]
    return p


def test_the_schedule_is_seeded_and_its_faults_ran(report: dict[str, Any]) -> None:
    sched = make_schedule(SEED, DURATION_S, TTL_S, kinds=KINDS)
    assert sched == make_schedule(SEED, DURATION_S, TTL_S, kinds=KINDS)  # a seed names a run
    assert report["faults_started"] == len(sched) >= 4, report["faults_by_kind"]
    assert prop(report, "exactly_once_exact_tokens")["accepted"] >= 40


def test_no_accepted_request_is_lost_duplicated_or_given_a_wrong_token(
    report: dict[str, Any],
) -> None:
    p = prop(report, "exactly_once_exact_tokens")
    assert p["accepted"] == p["submitted"] - p["never_accepted"], p
    assert p["lost"] == 0 and p["finished_twice"] == 0, p
    assert p["wrong_tokens"] == 0, p  # every token the oracle's, at its position, none extra


def test_every_accepted_request_finished_with_all_its_tokens(report: dict[str, Any]) -> None:
    p = prop(report, "exactly_once_exact_tokens")
    assert p["ended_with_error"] == 0, p
    assert p["result"] == "PASS", p


def test_requests_are_refused_only_while_a_fault_lasts(report: dict[str, Any]) -> None:
    p = prop(report, "refused_only_in_faults")
    assert p["outside_faults"] == 0, p


def test_ownership_converges_within_two_ttls_of_the_last_heal(report: dict[str, Any]) -> None:
    p = prop(report, "converged_after_heal")
    assert p["final_heal_to_converged_s"] is not None, p
    assert p["final_heal_to_converged_s"] <= 2 * TTL_S and p["stays_converged"], p


def test_no_kv_block_is_held_at_the_end(report: dict[str, Any]) -> None:
    p = prop(report, "no_kv_block_held")
    assert p["result"] == "PASS", p


def test_jetstream_consumers_are_bounded(report: dict[str, Any]) -> None:
    p = prop(report, "consumers_bounded")
    assert p["after_settle"] is not None and p["before_faults"] is not None, p
    assert p["after_settle"] <= p["before_faults"], p


def test_duplicate_gpu_work_is_measured_and_bounded(report: dict[str, Any]) -> None:
    p = prop(report, "duplicate_gpu_work")
    # The daemons' token counters are scraped every second and once at the end: a daemon
    # killed between two scrapes loses at most its last second, so the ratio reads a little
    # low, never near 0 unless the measurement broke. Above 1: tokens computed twice (an old
    # owner still driving a request its adopter recomputes); the issue measured 1.04-1.08.
    assert p["tokens_needed"] > 0 and p["ratio"] is not None, p
    assert 0.9 <= p["ratio"] <= 1.5, p
