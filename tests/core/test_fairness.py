"""Scheduling rule 12: priority classes, earliest deadline first, tenants' fair shares (virtual
token counters), shedding and demotion by the predicted wait."""

from __future__ import annotations

import pytest

from kvsched.core import (
    CacheConfig,
    CapacityExceeded,
    EngineConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepReport,
)
from kvsched.core.config import ConfigError, FairnessConfig
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.sim import SimExecutor

_base = iter(range(1000, 10**9, 100_000))  # distinct prompts: no prefix hits


def req(
    rid: str, prompt: int = 64, max_tokens: int = 8, deadline_ms: float = 0, **kw: object
) -> Request:
    b = next(_base)
    return Request(
        rid,
        list(range(b, b + prompt)),
        SamplingParams(max_tokens=max_tokens),
        ttft_deadline_ms=deadline_ms,
        **kw,  # type: ignore[arg-type]
    )


def make(
    budget: int = 64, seqs: int = 64, clock: list[float] | None = None, **fairness: object
) -> Scheduler:
    t = clock if clock is not None else [0.0]
    return Scheduler(
        EngineConfig(
            cache=CacheConfig(block_size=16, num_gpu_blocks=4096),
            scheduler=SchedulerConfig(
                max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=65536
            ),
            fairness=FairnessConfig(**fairness),  # type: ignore[arg-type]
        ),
        clock=lambda: t[0],
        instance_id="i0",
    )


def admission_order(s: Scheduler, n: int) -> list[str]:
    """Run s against a real WorkerEngine (sim, zero cost) until n requests were placed; their
    ids in placement order (one 64-token prompt fills the 64-token budget of a step)."""
    sc = s.config.scheduler
    worker = WorkerEngine(SimExecutor(zero_cost=True), s.block_size, sc.max_num_seqs, 2, 65536)
    order: list[str] = []
    prev: StepReport | None = None
    for _ in range(20 * n):
        if prev is not None:
            s.apply_report(prev)
        tasks = s.schedule()
        s.check_integrity()
        handles = {p.handle for p in tasks.placements}
        order += [r.req_id for r in s.running.values() if r.handle in handles]
        if len(order) >= n:
            return order
        worker.apply(tasks)
        prev = worker.step()
    raise AssertionError(f"only {order} were placed")


def test_earliest_deadline_first_within_a_class_then_the_better_class() -> None:
    s = make()
    s.add_request(req("late", deadline_ms=900))
    s.add_request(req("none"))  # implicit deadline: 8,000 ms after arrival
    s.add_request(req("soon", deadline_ms=100))
    s.add_request(req("low-class", deadline_ms=10, priority=1))
    s.add_request(req("mid", deadline_ms=400))
    s.add_request(req("high-class", deadline_ms=5000, priority=-1))
    order = admission_order(s, 6)
    assert order == ["high-class", "soon", "mid", "late", "none", "low-class"]


def test_an_implicit_deadline_ages_a_request_past_later_explicit_ones() -> None:
    t = [0.0]
    s = make(clock=t, default_ttft_deadline_ms=1000)
    s.add_request(req("old"))  # deadline 1.0 s
    t[0] = 0.5
    s.add_request(req("new", deadline_ms=2000))  # deadline 2.5 s
    s.add_request(req("urgent", deadline_ms=100))  # deadline 0.6 s
    assert admission_order(s, 3) == ["urgent", "old", "new"]


def test_a_preempted_request_goes_back_to_the_front_of_its_class_and_tenant() -> None:
    s = make()
    a, b, c = req("a"), req("b"), req("c")
    a.deadline, b.deadline, c.deadline = 0.5, 9.0, 0.1  # (add_request sets them)
    s.waiting.push(a)
    s.waiting.push_front(b)  # as _requeue does: first, whatever its deadline
    s.waiting.push(c)
    assert [r.req_id for r in s.waiting] == ["b", "c", "a"]
    assert [s.waiting.pop().req_id for _ in range(3)] == ["b", "c", "a"]


def run_backlogged(s: Scheduler, reqs: list[Request], steps: int) -> dict[str, int]:
    """Drive s with a real WorkerEngine (sim executor, zero cost) while every tenant still has
    requests waiting; return each tenant's served tokens (prompt tokens sent in chunks plus
    output tokens reported), counted from the Tasks and the requests, not the counters."""
    sc = s.config.scheduler
    worker = WorkerEngine(SimExecutor(zero_cost=True), s.block_size, sc.max_num_seqs, 2, 65536)
    for r in reqs:
        s.add_request(r)
    tenant_of = {r.req_id: r.tenant for r in reqs}
    by_handle: dict[int, str] = {}
    served = {t: 0 for t in tenant_of.values()}
    out_before = {r.req_id: 0 for r in reqs}
    prev: StepReport | None = None
    for _ in range(steps):
        if prev is not None:
            s.apply_report(prev)
        tasks = s.schedule()
        s.check_integrity()
        for r in s.running.values():
            by_handle[r.handle] = r.tenant
        for c in tasks.chunks:
            served[by_handle[c.handle]] += len(c.token_ids)
        worker.apply(tasks)
        prev = worker.step()
        waiting = {r.tenant for r in s.waiting}
        if len(waiting) < len(served):
            break  # a tenant is no longer backlogged
    else:
        raise AssertionError("no tenant ran out of waiting requests: raise the step limit")
    for r in reqs:
        served[tenant_of[r.req_id]] += len(r.output_token_ids) - out_before[r.req_id]
    return served


def test_two_tenants_with_weights_1_to_3_get_served_tokens_1_to_3_while_backlogged() -> None:
    s = make(budget=2048, seqs=8, tenant_weights={"a": 1.0, "b": 3.0})
    reqs = []
    for i in range(150):  # interleaved arrivals, identical shapes
        reqs.append(req(f"a{i}", prompt=256, max_tokens=32, tenant="a"))
        reqs.append(req(f"b{i}", prompt=256, max_tokens=32, tenant="b"))
    served = run_backlogged(s, reqs, 20_000)
    assert served["a"] > 5_000  # enough served to measure a share
    ratio = served["b"] / served["a"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, served


def test_without_weights_the_flooding_tenant_does_not_crowd_out_the_other() -> None:
    s = make(budget=2048, seqs=8)
    reqs = [req(f"f{i}", prompt=256, max_tokens=32, tenant="flood") for i in range(200)]
    reqs += [req(f"q{i}", prompt=256, max_tokens=32, tenant="quiet") for i in range(40)]
    served = run_backlogged(s, reqs, 20_000)  # quiet arrived last, still gets half
    assert 0.9 <= served["quiet"] / served["flood"] <= 1.1, served


def loaded(shed: str) -> Scheduler:
    """An instance with ~100 s of prefill queued (the H100 seed: 50 prompts of 30k tokens)."""
    s = make(budget=8192, shed=shed)
    for i in range(50):
        s.add_request(req(f"bulk{i}", prompt=30_000, max_tokens=4))
    s.schedule()
    s.check_integrity()
    return s


def state(s: Scheduler) -> tuple[object, ...]:
    return (
        sorted(s.requests),
        [r.req_id for r in s.waiting],
        sorted(s.running),
        s.kv.num_free_blocks,
        s.waiting.queued_ms,
        s.queued_prefill_ms,
        dict(s.tenants.counters),
    )


def test_a_request_that_cannot_meet_its_deadline_is_shed_and_nothing_else_changes() -> None:
    s = loaded("shed")
    before = state(s)
    wait = s.predicted_wait_ms(req("probe", prompt=1000))
    assert wait > 10_000  # the prediction sees the queued prefill
    with pytest.raises(CapacityExceeded, match=r"predicted time to first token [\d,]+ ms"):
        s.add_request(req("hopeless", prompt=1000, deadline_ms=2000))
    assert state(s) == before
    s.check_integrity()
    assert s.num_shed == 1
    # A deadline the prediction can meet is accepted; no deadline is never shed.
    s.add_request(req("patient", prompt=1000, deadline_ms=3_600_000))
    s.add_request(req("no-deadline", prompt=1000))
    assert {"patient", "no-deadline"} <= set(s.requests)
    s.schedule()
    s.check_integrity()


def test_demote_queues_it_behind_every_request_not_demoted() -> None:
    s = loaded("demote")
    s.add_request(req("hopeless", prompt=1000, deadline_ms=2000))
    s.add_request(req("later", prompt=1000))
    assert s.num_demoted == 1 and s.requests["hopeless"].demoted
    queued = [r.req_id for r in s.waiting]
    assert queued[-1] == "hopeless" and queued[-2] == "later"
    s.check_integrity()


def test_with_shedding_off_a_late_deadline_only_orders() -> None:
    s = loaded("off")
    s.add_request(req("hopeless", prompt=1000, deadline_ms=2000))
    assert next(r.req_id for r in s.waiting) == "hopeless"  # earliest deadline first


def test_fairness_config_checks_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"fairness\.shed"):
        EngineConfig(fairness=FairnessConfig(shed="sometimes")).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"fairness\.tenant_weights\.a"):
        EngineConfig(fairness=FairnessConfig(tenant_weights={"a": 0.0})).validate()
    cfg = EngineConfig.from_dict({"fairness": {"tenant_weights": {"a": 2}, "shed": "demote"}})
    assert cfg.fairness.weight("a") == 2 and cfg.fairness.weight("z") == 1.0
