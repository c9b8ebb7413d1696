"""The host-memory KV tier (kvsched/core/tiers.py): write policies, swap-ins of host hits, pins
held until a report acknowledges the copies, failed copies, reset, the cost model's veto.

A "worker" here is `work()`: it runs a Tasks message's chunks and decodes like
tests/core/factories.run_tasks, with control over which messages its report says it applied
(late acknowledgements) and which copies failed."""

from __future__ import annotations

from typing import Any

from kvsched.core import Request, Scheduler, StepReport, Tasks
from tests.core.factories import make_config, make_request, make_scheduler

BS = 16
A = list(range(1000, 1048))  # 3 full blocks


def sched(**kw: Any) -> Scheduler:
    kw.setdefault("block_size", BS)
    kw.setdefault("num_gpu_blocks", 8)
    kw.setdefault("num_host_blocks", 16)
    kw.setdefault("prealloc_threshold", 0)
    kw.setdefault("prealloc_blocks", 1)
    return make_scheduler(**kw)


def work(
    s: Scheduler,
    tasks: Tasks,
    applied: int | None = None,
    failed_swap_ins: list[int] | None = None,
    failed_swap_outs: list[int] | None = None,
    skip: set[int] | None = None,
) -> None:
    """Run `tasks` as one worker step and report it (applied: the applied_seq to report;
    skip: handles that do not run, e.g. whose swap-in failed)."""
    skip = skip or set()
    rows: list[tuple[int, int, list[int]]] = []
    chunked = set()
    for c in tasks.chunks:
        if c.handle in skip or c.handle not in s.live:
            continue
        chunked.add(c.handle)
        req = s.live[c.handle]
        end = c.start + len(c.token_ids)
        rows.append((c.handle, end, [7] if end >= req.num_prefill_tokens else []))
    for req in list(s.running.values()):
        runs = req.handle not in chunked and req.is_prefill_done and req.handle not in skip
        if runs and req.num_tokens <= len(req.block_ids) * s.block_size:
            rows.append((req.handle, req.num_tokens, [7]))
    s.apply_report(
        StepReport(
            step=s.last_report_step + 1,
            applied_seq=s.last_tasks_seq if applied is None else applied,
            handles=[h for h, _, _ in rows],
            num_computed=[c for _, c, _ in rows],
            num_new_tokens=[len(t) for _, _, t in rows],
            token_ids=[t for _, _, ts in rows for t in ts],
            acked=tasks.preempts + tasks.aborts,
            failed_swap_ins=failed_swap_ins or [],
            failed_swap_outs=failed_swap_outs or [],
        )
    )
    s.check_integrity()


def run_to_end(s: Scheduler, *reqs: Request, limit: int = 50) -> list[Tasks]:
    """schedule + work until every request finished and every copy is acknowledged; returns
    the Tasks sent."""
    for r in reqs:
        s.add_request(r)
    sent = []
    host = s.kv.host
    for _ in range(limit):
        busy = host is not None and (host.has_queued() or host.num_in_flight)
        if all(r.is_finished for r in reqs) and not busy:
            return sent
        t = s.schedule()
        s.check_integrity()
        sent.append(t)
        work(s, t)
    raise AssertionError("requests did not finish")


def host_hashes(s: Scheduler) -> set[bytes]:
    assert s.kv.host is not None
    return set(s.kv.host.pool.cached)


def test_without_host_blocks_nothing_changes() -> None:
    s = make_scheduler(block_size=BS, num_gpu_blocks=8)
    assert s.kv.host is None
    a = make_request(A + [1], max_tokens=1)
    for t in run_to_end(s, a):
        assert not (t.swap_out_gpu or t.swap_in_gpu)
    assert s.snapshot().num_host_blocks == 0


def test_write_back_copies_evicted_blocks_in_the_message_that_reuses_them() -> None:
    s = sched(host_write_policy="write_back")
    a = make_request(A + [1], max_tokens=1)
    sent = run_to_end(s, a)
    assert not any(t.swap_out_gpu for t in sent), "write_back copies nothing before eviction"
    a_blocks = [s.kv.pool.lookup(h) for h in a.block_hashes[:3]]
    x = make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1)  # needs all 8 blocks
    s.add_request(x)
    t = s.schedule()
    s.check_integrity()
    # The evicted blocks are copied out in the same message whose chunk overwrites them.
    assert sorted(t.swap_out_gpu) == sorted(a_blocks)
    assert set(a_blocks) <= set(x.block_ids) and t.chunks[0].handle == x.handle
    assert host_hashes(s) == set(), "a host block is a hit only after the ack"
    work(s, t)
    assert host_hashes(s) == set(a.block_hashes[:3])
    assert s.kv.where(a.block_hashes[0]) == (None, s.kv.host.lookup(a.block_hashes[0]))


def test_host_hits_are_swapped_in_and_the_first_chunk_starts_after_them() -> None:
    s = sched(host_write_policy="write_back")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1))
    host = s.kv.host
    assert host is not None
    src = [host.lookup(h) for h in a.block_hashes[:3]]
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    s.add_request(b)
    t = s.schedule()
    s.check_integrity()
    (pl,) = t.placements
    assert pl.num_cached_tokens == 48 and t.chunks[0].start == 48
    assert t.swap_in_handles == [b.handle] * 3 and t.swap_in_host == src
    assert t.swap_in_gpu == b.block_ids[:3]
    assert [host.pool.ref_cnt[x] for x in src] == [1, 1, 1], "sources pinned until the ack"
    # Not a GPU hit for another request before a report acknowledges the swap-in: it swaps
    # in its own copy from the same host blocks.
    c = make_request(A + list(range(9100, 9110)), max_tokens=2)
    s.add_request(c)
    t2 = s.schedule()
    s.check_integrity()
    b_blocks, c_blocks = b.block_ids[:3], c.block_ids[:3]
    assert not set(b_blocks) & set(c_blocks)
    assert t2.swap_in_host == src and [host.pool.ref_cnt[x] for x in src] == [2, 2, 2]
    work(s, t)  # the worker applied both messages
    work(s, t2)
    assert [host.pool.ref_cnt[x] for x in src] == [0, 0, 0]
    snap = s.snapshot()
    assert snap.prefix_cache_host_hit_tokens == 96 and snap.prefix_cache_hit_tokens >= 96
    assert snap.num_swap_ins == 6
    # Once reported, b's swapped-in blocks are GPU hits.
    d = make_request(A + list(range(9200, 9210)), max_tokens=2)
    s.add_request(d)
    t3 = s.schedule()
    s.check_integrity()
    assert not t3.swap_in_gpu and d.block_ids[:3] in (b_blocks, c_blocks)


def test_write_through_copies_each_registered_block_once() -> None:
    s = sched(host_write_policy="write_through")
    a = make_request(A + [1], max_tokens=1)
    sent = run_to_end(s, a)
    outs = [g for t in sent for g in t.swap_out_gpu]
    assert sorted(outs) == sorted(s.kv.pool.lookup(h) for h in a.block_hashes[:3])
    assert host_hashes(s) == set(a.block_hashes[:3])
    b = make_request(A + [2], max_tokens=1)  # GPU hits: nothing copied again
    sent = run_to_end(s, b)
    assert not any(t.swap_out_gpu for t in sent)


def test_write_through_selective_copies_after_n_hits() -> None:
    s = sched(host_write_policy="write_through_selective", host_write_hits=2, num_gpu_blocks=12)
    a = make_request(A + [1], max_tokens=1)
    assert not any(t.swap_out_gpu for t in run_to_end(s, a))
    b = make_request(A + [2], max_tokens=1)
    assert not any(t.swap_out_gpu for t in run_to_end(s, b)), "one hit: not yet"
    c = make_request(A + [3], max_tokens=1)
    sent = run_to_end(s, c)
    assert sum(len(t.swap_out_gpu) for t in sent) == 3, "the second hit copies the 3 blocks"
    assert host_hashes(s) == set(a.block_hashes[:3])


def test_unacknowledged_copies_pin_host_blocks_and_late_acks_release_them() -> None:
    s = sched(host_write_policy="write_through", num_host_blocks=3)
    a = make_request(A + [1], max_tokens=1)
    s.add_request(a)
    t1 = s.schedule()
    work(s, t1)  # the prompt ran: its 3 blocks are registered, copies queued
    t2 = s.schedule()
    assert len(t2.swap_out_gpu) == 3
    host = s.kv.host
    assert host is not None and host.num_free == 0
    # Reports that have not applied t2 (late) leave the copies pinned.
    b = make_request(list(range(3000, 3048)) + [1], max_tokens=1)
    s.add_request(b)
    t3 = s.schedule()
    work(s, t3, applied=t1.seq)
    assert host.num_free == 0 and not host_hashes(s)
    t4 = s.schedule()
    assert not t4.swap_out_gpu, "every host block is pinned: b's copies are skipped"
    assert host.stats.swap_outs_skipped == 3
    work(s, t4)  # applied everything: t2's copies are done
    assert host_hashes(s) == set(a.block_hashes[:3])
    assert host.pool.ref_cnt == [0, 0, 0]


def test_failed_swap_out_registers_nothing() -> None:
    s = sched(host_write_policy="write_through")
    a = make_request(A + [1], max_tokens=1)
    s.add_request(a)
    work(s, s.schedule())
    t = s.schedule()
    work(s, t, failed_swap_outs=t.swap_out_host[:1])
    assert len(host_hashes(s)) == 2
    assert s.kv.host is not None and s.kv.host.stats.swap_out_failures == 1


def test_failed_swap_in_preempts_and_recomputes_without_the_suspect_block() -> None:
    s = sched(host_write_policy="write_back")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1))
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    s.add_request(b)
    t = s.schedule()
    assert t.swap_in_gpu
    handle = b.handle
    work(s, t, failed_swap_ins=[handle], skip={handle})
    assert b.status.name == "PREEMPTED"
    t2 = s.schedule()
    assert handle in t2.preempts
    work(s, t2)  # acknowledges the preempt: b waits again
    assert not host_hashes(s) & set(b.block_hashes[:3]), "the failed sources are forgotten"
    for _ in range(10):
        if b.is_finished:
            break
        t = s.schedule()
        s.check_integrity()
        work(s, t)
    assert b.is_finished and b.num_output_tokens == 2
    assert b.num_cached_tokens == 48, "its first placement's hit counts, as for any preemption"


def test_reset_during_swaps_clears_both_tiers_and_in_flight_copies_register_nothing() -> None:
    s = sched(host_write_policy="write_through")
    a = make_request(A + [1], max_tokens=1)
    s.add_request(a)
    work(s, s.schedule())
    t = s.schedule()
    assert t.swap_out_gpu
    s.reset_prefix_cache()
    s.check_integrity()
    t2 = s.schedule()
    assert t2.reset_prefix_cache
    work(s, t2)  # acknowledges t's copies after the reset
    assert not host_hashes(s) and not s.kv.pool.cached
    assert s.kv.host is not None and s.kv.host.num_free == 16


def test_swap_in_declined_when_the_cost_model_says_recompute_is_cheaper() -> None:
    cfg = make_config(
        block_size=BS,
        num_gpu_blocks=8,
        num_host_blocks=16,
        host_write_policy="write_back",
        prealloc_threshold=0,
        prealloc_blocks=1,
    )
    cfg.step_cost.per_swapped_block_ms = 1e3
    s = Scheduler(cfg)
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1))
    assert host_hashes(s) >= set(a.block_hashes[:3])
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    s.add_request(b)
    t = s.schedule()
    assert not t.swap_in_gpu and t.placements[0].num_cached_tokens == 0
    assert s.snapshot().num_swap_ins_declined == 3


def test_swapped_blocks_feed_the_step_cost_model() -> None:
    s = sched(host_write_policy="write_through")
    a = make_request(A + [1], max_tokens=4)
    s.add_request(a)
    t = s.schedule()
    work(s, t)
    t = s.schedule()
    assert len(t.swap_out_gpu) == 3
    rows_before = len(s.cost._rows)
    r = StepReport(
        step=s.last_report_step + 1,
        applied_seq=t.seq,
        handles=[a.handle],
        num_computed=[a.num_tokens],
        num_new_tokens=[1],
        token_ids=[7],
        step_time_ns=5_000_000,
    )
    s.apply_report(r)
    assert s.cost._rows[rows_before:][-1][5] == 3, "the step's copies are its swapped blocks"


def test_preemption_before_the_swap_in_is_acknowledged_keeps_pins_until_the_ack() -> None:
    """b is placed with swap-ins, then preempted (pause) before any report covers them: its
    GPU blocks go back unregistered (the copy may not have run), the host sources stay pinned
    until a report acknowledges the swap-in message, and b recomputes with host hits again."""
    s = sched(host_write_policy="write_back")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(list(range(5000, 5000 + 8 * BS - 1)), max_tokens=1))
    host = s.kv.host
    assert host is not None
    src = [host.lookup(h) for h in a.block_hashes[:3]]
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    s.add_request(b)
    t1 = s.schedule()
    assert t1.swap_in_host == src
    swapped_into = list(t1.swap_in_gpu)
    s.pause()  # preempts b before the worker's report on t1
    s.check_integrity()
    assert [host.pool.ref_cnt[x] for x in src] == [1, 1, 1], "pinned until the ack"
    assert all(s.kv.pool.block_hash[g] is None for g in swapped_into), "registered too early"
    t2 = s.schedule()
    assert b.handle in t2.preempts
    work(s, t1, applied=t1.seq, skip={b.handle})  # a report that applied t1 only
    assert [host.pool.ref_cnt[x] for x in src] == [0, 0, 0]
    assert b.status.name == "PREEMPTED"
    work(s, t2)  # now t2's preempt is acknowledged too: b waits again
    assert b.status.name == "WAITING"
    s.resume()
    sent = []
    for _ in range(20):
        if b.is_finished:
            break
        sent.append(s.schedule())
        s.check_integrity()
        work(s, sent[-1])
    assert any(t.swap_in_host == src for t in sent), "b's recompute swaps the prefix in again"
    assert b.is_finished and b.num_output_tokens == 2
