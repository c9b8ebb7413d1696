"""Storage -> host prefetch (kvsched/core/prefetch.py): a queued request's storage hits are got
into pinned host blocks while it waits, registered when acknowledged and swapped in at its
placement (no storage fetch on the step); the pins are released at placement, on abort (at
the ack when in flight), under host-tier pressure, and nothing leaks when the worker fails a
prefetch or the instance is lost mid-prefetch. check_integrity runs after every step.

A "worker" here is `work()`: it runs a Tasks message's chunks and decodes as
tests/core/test_storage_tier.work does, and names the prefetches that failed."""

from __future__ import annotations

from typing import Any

from kvsched.core import Request, Scheduler, StepReport, StorageIndex, Tasks
from tests.core.factories import make_config, make_request

BS = 16
A = list(range(1000, 1048))  # 3 full blocks
B = list(range(9000, 9010))  # the blocker: holds the only slot


def sched(index: StorageIndex, clock: Any = None, **kw: Any) -> Scheduler:
    kw.setdefault("storage_prefetch", True)
    kw.setdefault("storage_prefetch_hold_ms", 0.0)  # (tests of the hold set it)
    kw.setdefault("block_size", BS)
    kw.setdefault("num_gpu_blocks", 16)
    kw.setdefault("num_host_blocks", 16)
    kw.setdefault("max_num_seqs", 1)
    kw.setdefault("prealloc_threshold", 0)
    kw.setdefault("prealloc_blocks", 1)
    kw.setdefault("max_model_len", 8192)
    cfg = make_config(**kw)
    cfg.step_cost.per_fetched_block_ms = 1e-4  # a fetch is always worth it here
    cfg.step_cost.per_swapped_block_ms = 1e-4
    return Scheduler(
        cfg, clock=clock or (lambda: 0.0), instance_id="i0", storage=index, storage_namespace="m"
    )


def store(s: Scheduler, index: StorageIndex, tokens: list[int], n: int) -> list[str]:
    """Mark the first n blocks of `tokens` stored (acknowledged writes); returns their keys."""
    probe = make_request(tokens + [1])
    s.kv.ensure_hashes(probe, n)
    assert s.kv.storage is not None
    keys = s.kv.storage.keys(probe.block_hashes[:n])
    for k in keys:
        assert index.begin_write(k)
        index.end_write(k, True)
    return keys


def work(
    s: Scheduler,
    tasks: Tasks,
    applied: int | None = None,
    failed_prefetches: list[int] | None = None,
) -> None:
    """Run `tasks` as one worker step and report it; check integrity."""
    rows: list[tuple[int, int, list[int]]] = []
    chunked = set()
    for c in tasks.chunks:
        if c.handle not in s.live:
            continue
        chunked.add(c.handle)
        req = s.live[c.handle]
        end = c.start + len(c.token_ids)
        rows.append((c.handle, end, [7] if end >= req.num_prefill_tokens else []))
    for req in list(s.running.values()):
        runs = req.handle not in chunked and req.is_prefill_done
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
            failed_storage_prefetches=failed_prefetches or [],
        )
    )
    s.check_integrity()


def step(s: Scheduler, **kw: Any) -> Tasks:
    t = s.schedule()
    s.check_integrity()
    work(s, t, **kw)
    return t


def drain(s: Scheduler, *reqs: Request, limit: int = 80) -> list[Tasks]:
    """Step until `reqs` and every other live request finished and no prefetch is held."""
    reqs = (*reqs, *s.requests.values())
    sent = []
    pf = s.kv.prefetch
    for _ in range(limit):
        quiet = pf is None or (pf.num_pinned == 0 and pf.num_in_flight == 0)
        if all(r.is_finished for r in reqs) and quiet:
            return sent
        sent.append(step(s))
    raise AssertionError("requests did not finish")


def nothing_leaked(s: Scheduler) -> None:
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    host, pf = s.kv.host, s.kv.prefetch
    assert host is not None and pf is not None
    assert host.num_free == host.num_blocks, "host blocks leaked"
    assert pf.num_pinned == 0 and pf.num_in_flight == 0


def blocked(s: Scheduler, index: StorageIndex) -> tuple[Request, list[str], Tasks]:
    """A blocker holds the only slot; a request whose prompt A is stored waits behind it. The
    step after it was queued carries its prefetch (returned unapplied)."""
    keys = store(s, index, A, 3)
    blocker = make_request(B, max_tokens=6)
    s.add_request(blocker)
    step(s)
    req = make_request(A + [1], max_tokens=1)
    s.add_request(req)
    t = s.schedule()
    s.check_integrity()
    return req, keys, t


def test_a_waiting_request_is_prefetched_and_placed_with_swap_ins_not_fetches() -> None:
    index = StorageIndex()
    s = sched(index)
    req, keys, t = blocked(s, index)
    assert t.storage_prefetch_keys == keys  # at the queue's head, waiting: prefetched
    hosts = list(t.storage_prefetch_host)
    assert len(set(hosts)) == 3 and not t.storage_fetch_keys
    pf, host = s.kv.prefetch, s.kv.host
    assert pf is not None and host is not None
    assert pf.num_pinned == 3 and pf.num_in_flight == 3  # sent: the message is numbered
    assert all(host.pool.block_hash[b] is None for b in hosts)  # not a hit before the ack
    work(s, t)
    assert sorted(host.pool.cached.values()) == sorted(hosts)  # landed: registered, pinned
    assert all(host.pool.ref_cnt[b] == 1 for b in hosts)
    sent = drain(s, req)
    placed = next(x for x in sent if any(p.req_id == req.req_id for p in x.placements))
    assert sorted(placed.swap_in_host) == sorted(hosts)  # host hits, over PCIe
    assert not any(x.storage_fetch_keys for x in sent)  # nothing fetched on a step
    assert req.num_cached_tokens == 48 and req.num_storage_cached_tokens == 48
    assert not req.num_host_cached_tokens  # counted as storage hits (their origin)
    assert pf.stats.prefetches == 3 and pf.stats.hits == 3 and pf.stats.unused == 0
    assert s.kv.num_prefetched_hits == 48 == s.kv.num_storage_hits
    snap = s.snapshot()
    assert snap.num_storage_prefetches == 3 and snap.prefix_cache_prefetched_hit_tokens == 48
    nothing_leaked(s)


def test_without_a_wait_nothing_is_prefetched_and_the_storage_hits_are_fetched() -> None:
    index = StorageIndex()
    s = sched(index)
    keys = store(s, index, A, 3)
    req = make_request(A + [1], max_tokens=1)
    s.add_request(req)
    t = s.schedule()
    assert not t.storage_prefetch_keys and t.storage_fetch_keys == keys
    work(s, t)
    drain(s, req)
    nothing_leaked(s)


def test_abort_while_in_flight_keeps_the_pins_until_the_ack() -> None:
    index = StorageIndex()
    s = sched(index)
    req, _, t = blocked(s, index)
    pf, host = s.kv.prefetch, s.kv.host
    assert pf is not None and host is not None
    s.abort(req.req_id)
    s.check_integrity()
    assert pf.num_pinned == 3  # the worker may be writing those host blocks now
    assert all(host.pool.ref_cnt[b] == 1 for b in t.storage_prefetch_host)
    work(s, t)  # the ack
    assert pf.num_pinned == 0 and pf.stats.unused == 3
    # What it brought stays in the host tier (unpinned: a hit for the next request).
    assert sorted(host.pool.cached.values()) == sorted(t.storage_prefetch_host)
    drain(s)
    nothing_leaked(s)


def test_abort_before_the_message_releases_at_once_and_sends_nothing() -> None:
    now = [0.0]
    index = StorageIndex()
    s = sched(
        index,
        clock=lambda: now[0],
        storage_prefetch_hold_ms=100.0,
        storage_prefetch_at_arrival=True,
    )
    store(s, index, A, 3)
    req = make_request(A + [1], max_tokens=1)
    s.add_request(req)  # prefetched from its arrival
    pf = s.kv.prefetch
    assert pf is not None and pf.num_pinned == 3 and pf.has_queued()
    s.check_integrity()
    s.abort(req.req_id)
    s.check_integrity()
    assert pf.num_pinned == 0 and not pf.has_queued()
    t = s.schedule()
    assert not t.storage_prefetch_keys
    nothing_leaked(s)


def test_hold_places_the_request_once_its_prefetch_landed() -> None:
    now = [0.0]
    index = StorageIndex()
    s = sched(
        index,
        clock=lambda: now[0],
        storage_prefetch_hold_ms=100.0,
        storage_prefetch_at_arrival=True,
    )
    store(s, index, A, 3)
    req = make_request(A + [1], max_tokens=1)
    s.add_request(req)
    t = s.schedule()  # held: the slot is free but its prefetch is not in
    s.check_integrity()
    assert not t.placements and len(t.storage_prefetch_keys) == 3
    assert s.hold_until == 0.1  # the engine steps again by then, report or not
    now[0] = 0.01
    work(s, t)
    t2 = s.schedule()
    assert [p.req_id for p in t2.placements] == [req.req_id]
    assert len(t2.swap_in_host) == 3 and not t2.storage_fetch_keys
    work(s, t2)
    drain(s, req)
    assert req.num_storage_cached_tokens == 48
    nothing_leaked(s)


def test_hold_is_bounded_a_prefetch_never_acknowledged_does_not_stall_the_request() -> None:
    now = [0.0]
    index = StorageIndex()
    s = sched(
        index,
        clock=lambda: now[0],
        storage_prefetch_hold_ms=100.0,
        storage_prefetch_at_arrival=True,
    )
    keys = store(s, index, A, 3)
    req = make_request(A + [1], max_tokens=1)
    s.add_request(req)
    t = s.schedule()
    assert not t.placements
    work(s, t, applied=0)  # a step that applied nothing yet: still in flight
    now[0] = 0.2  # past the hold: placed, its storage hits fetched on the step
    t2 = s.schedule()
    s.check_integrity()
    assert [p.req_id for p in t2.placements] == [req.req_id] and s.hold_until is None
    assert t2.storage_fetch_keys == keys and not t2.swap_in_host
    pf = s.kv.prefetch
    assert pf is not None and pf.num_pinned == 3  # in flight: released at its ack
    work(s, t2)  # acknowledges both messages
    assert pf.num_pinned == 0 and pf.stats.hits == 0 and pf.stats.unused == 3
    drain(s, req)
    nothing_leaked(s)


def test_a_failed_prefetch_registers_nothing_and_forgets_its_keys() -> None:
    index = StorageIndex()
    s = sched(index)
    req, keys, t = blocked(s, index)
    work(s, t, failed_prefetches=list(t.storage_prefetch_host[1:]))  # blocks 1 and 2 failed
    host, pf = s.kv.host, s.kv.prefetch
    assert host is not None and pf is not None
    assert keys[0] in index and keys[1] not in index and keys[2] not in index
    assert list(host.pool.cached.values()) == [t.storage_prefetch_host[0]]
    assert pf.stats.failures == 2
    sent = drain(s, req)
    assert not any(x.storage_fetch_keys for x in sent)
    assert req.num_cached_tokens == 16  # block 0 prefetched, the rest recomputed
    assert pf.stats.hits == 1
    nothing_leaked(s)


def test_host_pressure_releases_landed_prefetches_for_swap_outs() -> None:
    index = StorageIndex()
    s = sched(index, num_host_blocks=12)  # at most 3 pinned by prefetches
    req, _, t = blocked(s, index)
    work(s, t)
    pf, host = s.kv.prefetch, s.kv.host
    assert pf is not None and host is not None and pf.num_pinned == 3
    # Eleven swap-outs at once (GPU blocks evicted under write_back): 9 host blocks are free,
    # so the landed prefetch gives its pins back first.
    for i in range(11):
        host.copy_out(i % 16, bytes([i]) * 8)
    t2 = s.schedule()
    s.check_integrity()
    assert len(t2.swap_out_host) == 11
    assert pf.num_pinned == 0 and pf.stats.relieved == 3 and not pf.has(req)
    work(s, t2)
    drain(s, req)  # placed with what the host LRU kept (nothing of A: it was taken)
    nothing_leaked(s)


def test_the_pin_cap_bounds_prefetches() -> None:
    index = StorageIndex()
    s = sched(index, num_host_blocks=8)  # at most 2 pinned by prefetches
    _, keys, t = blocked(s, index)
    assert t.storage_prefetch_keys == keys[:2]  # the run's first two; the third is fetched
    work(s, t)
    drain(s)
    nothing_leaked(s)


def test_an_instance_lost_mid_prefetch_leaves_the_shared_index_whole() -> None:
    """The engine drops a lost instance's scheduler (`close`) and queues its requests on
    another: the prefetch claimed nothing shared, and the request is served there."""
    index = StorageIndex()
    s = sched(index)
    req, keys, t = blocked(s, index)
    assert t.storage_prefetch_keys  # in flight when the worker is lost
    s.close()
    assert all(k in index and not index.is_writing(k) for k in keys)
    s2 = sched(index)
    moved = make_request(A + [1], max_tokens=1)
    moved.req_id = req.req_id
    s2.add_request(moved)
    sent = drain(s2, moved)
    assert any(x.storage_fetch_keys == keys for x in sent)  # fetched there, not waited for
    assert moved.num_storage_cached_tokens == 48
    nothing_leaked(s2)


def test_a_prefetch_under_way_is_waited_for_never_fetched_twice() -> None:
    """The default: the queue's head was prefetched while it waited; its slot frees before the
    prefetch landed: it stays queued until the ack (bounded), then takes swap-ins."""
    now = [0.0]
    index = StorageIndex()
    s = sched(index, clock=lambda: now[0], storage_prefetch_hold_ms=100.0)
    req, _, t = blocked(s, index)
    blocker = next(r for r in s.requests.values() if r is not req)
    s.abort(blocker.req_id)  # the slot is free; the prefetch is still in flight
    t2 = s.schedule()
    s.check_integrity()
    assert not t2.placements and not t2.storage_fetch_keys
    work(s, t2, applied=t.seq - 1)  # the prefetch's message not applied yet
    now[0] = 0.05
    t3 = s.schedule()
    assert not t3.placements
    work(s, t3)  # applies everything: the prefetch landed
    t4 = s.schedule()
    assert [p.req_id for p in t4.placements] == [req.req_id]
    assert len(t4.swap_in_host) == 3 and not t4.storage_fetch_keys
    work(s, t4)
    drain(s, req)
    assert req.num_storage_cached_tokens == 48
    nothing_leaked(s)
