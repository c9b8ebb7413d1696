"""The encoder cache (kvsched/core/encoder_cache.py): the encoder budget pays only for items the
worker does not hold, eviction only of items no running request needs, drops sent in Tasks,
reset with the prefix cache, and check_integrity over it."""

from __future__ import annotations

import pytest

from kvsched.core import InvalidRequest, Scheduler, Tasks
from tests.core.factories import make_request, make_scheduler, mm, run_tasks, step


def chunks(t: Tasks) -> list[tuple[int, int]]:
    return [(c.start, len(c.token_ids)) for c in t.chunks]


def finish_prefill(s: Scheduler) -> None:
    """Steps until nothing prefills (every request decodes or finished)."""
    for _ in range(20):
        if not s.prefilling and not s.waiting:
            return
        step(s)
    raise AssertionError("prefill did not finish")


def test_budget_is_charged_only_for_items_not_cached() -> None:
    kw = dict(max_num_batched_tokens=1000, max_num_encoder_tokens=100)
    on = make_scheduler(encoder_cache_size=1000, **kw)
    off = make_scheduler(**kw)
    for s in (on, off):
        s.add_request(make_request(120, max_tokens=50, mm_ranges=[mm(10, 80, "cat")]))
        finish_prefill(s)
        # Two more requests with the same image (other text: no KV hit), one with a new one.
        for h in ("cat", "cat", "dog"):
            s.add_request(make_request(120, max_tokens=2, mm_ranges=[mm(10, 80, h)]))
    t_on, _ = step(on)
    t_off, _ = step(off)
    # Cache on: both cats are hits (free), the dog a miss of 80 <= 100: all three whole.
    assert chunks(t_on) == [(0, 120)] * 3
    assert on.enc is not None and (on.enc.stats.hits, on.enc.stats.misses) == (2, 2)
    snap = on.snapshot()
    assert (snap.encoder_cache_hits, snap.encoder_cache_misses) == (2, 2)
    assert snap.encoder_cache_used == 160
    # Cache off: every image pays 80: the second and third stop before their image.
    assert chunks(t_off) == [(0, 120), (0, 10), (0, 10)]


def test_a_miss_larger_than_the_budget_runs_alone() -> None:
    s = make_scheduler(max_num_encoder_tokens=50, encoder_cache_size=500)
    a = make_request(120, max_tokens=2, mm_ranges=[mm(10, 80, "a")])
    b = make_request(120, max_tokens=2, mm_ranges=[mm(10, 30, "b")])
    s.add_request(a)
    s.add_request(b)
    t1, _ = step(s)
    assert chunks(t1) == [(0, 120), (0, 10)]  # a's 80 > 50 runs (budget untouched); b waits
    t2, _ = step(s)
    assert chunks(t2) == [(10, 110)]


def test_eviction_only_of_items_no_running_request_needs() -> None:
    s = make_scheduler(encoder_cache_size=100)
    a = make_request(100, max_tokens=5, mm_ranges=[mm(10, 60, "a")])
    s.add_request(a)
    t1 = s.schedule()  # a's chunk is sent, not yet run: the worker needs "a"
    assert chunks(t1) == [(0, 100)]
    b = make_request(100, max_tokens=2, mm_ranges=[mm(10, 60, "b")])
    s.add_request(b)
    t2 = s.schedule()
    s.check_integrity()
    assert chunks(t2) == [(0, 10)]  # "b" does not fit beside the needed "a": b stops before it
    assert t2.encoder_drops == []
    run_tasks(s, t1)  # a's prompt ran: its KV is past "a"
    run_tasks(s, t2)
    s.check_integrity()
    t3, _ = step(s)
    assert chunks(t3) == [(10, 90)]
    assert t3.encoder_drops == ["a"]  # evicted for "b", and the worker is told
    assert s.enc is not None and s.enc.stats.evictions == 1
    assert "a" not in s.enc and "b" in s.enc


def test_lru_order_among_unneeded_items() -> None:
    s = make_scheduler(encoder_cache_size=100)
    for h in ("x", "y"):
        s.add_request(make_request(60, max_tokens=1, mm_ranges=[mm(0, 40, h)]))
        finish_prefill(s)
    s.add_request(make_request(60, max_tokens=1, mm_ranges=[mm(0, 40, "x")]))  # x used again
    finish_prefill(s)
    s.add_request(make_request(60, max_tokens=1, mm_ranges=[mm(0, 40, "z")]))
    t, _ = step(s)
    assert t.encoder_drops == ["y"]  # the least recently used, not the oldest inserted
    assert s.enc is not None and set(s.enc.items) == {"x", "z"}


def test_a_preempted_request_no_longer_holds_its_items() -> None:
    s = make_scheduler(encoder_cache_size=100)
    a = make_request(100, max_tokens=5, mm_ranges=[mm(10, 60, "a")])
    s.add_request(a)
    s.schedule()  # sent, never run
    assert s.enc is not None and s.table.enc_needed(a, a.handle, "a")
    s.pause()  # preempts every placed request
    assert not s.table.enc_needed(a, a.handle, "a")
    s.check_integrity()


def test_reset_forgets_unneeded_items_and_the_next_use_misses() -> None:
    s = make_scheduler(encoder_cache_size=1000)
    s.add_request(make_request(100, max_tokens=1, mm_ranges=[mm(10, 60, "cat")]))
    finish_prefill(s)
    assert s.enc is not None and "cat" in s.enc
    s.reset_prefix_cache()
    assert "cat" not in s.enc and s.enc.used == 0
    s.add_request(make_request(100, max_tokens=1, mm_ranges=[mm(10, 60, "cat")]))
    t, _ = step(s)
    assert t.reset_prefix_cache and t.encoder_drops == []  # the reset covers every drop
    assert (s.enc.stats.hits, s.enc.stats.misses) == (0, 2)


def test_reset_keeps_items_a_running_request_needs() -> None:
    s = make_scheduler(encoder_cache_size=1000)
    a = make_request(100, max_tokens=5, mm_ranges=[mm(10, 60, "cat")])
    s.add_request(a)
    s.schedule()  # a's chunk in flight
    s.reset_prefix_cache()
    assert s.enc is not None and "cat" in s.enc  # counted: the worker re-encodes it on demand
    s.check_integrity()


def test_integrity_catches_a_drifted_cache() -> None:
    s = make_scheduler(encoder_cache_size=100)
    s.add_request(make_request(100, max_tokens=1, mm_ranges=[mm(10, 60, "cat")]))
    step(s)
    assert s.enc is not None
    s.enc.used += 50
    with pytest.raises(AssertionError, match="used drifted"):
        s.check_integrity()
    s.enc.used -= 50
    s.enc.items["cat"] = 200
    s.enc.used = 200
    with pytest.raises(AssertionError, match="over capacity"):
        s.check_integrity()


def test_an_item_larger_than_the_cache_is_rejected() -> None:
    s = make_scheduler(encoder_cache_size=50)
    with pytest.raises(InvalidRequest, match="encoder_cache_size"):
        s.add_request(make_request(100, mm_ranges=[mm(10, 60)]))


def test_many_requests_sharing_few_items_all_finish() -> None:
    """Bounded churn: 30 requests over 5 items in a cache of 3, chunked prompts; the cache
    never exceeds capacity and every request finishes."""
    s = make_scheduler(encoder_cache_size=150, max_num_batched_tokens=120, max_num_seqs=4)
    reqs = [
        make_request(200, max_tokens=3, mm_ranges=[mm(20, 50, f"i{i % 5}"), mm(100, 40, "j")])
        for i in range(30)
    ]
    for r in reqs:
        s.add_request(r)
    for _ in range(400):
        if not s.requests:
            break
        step(s)
    assert not s.requests
    assert all(r.is_finished for r in reqs)
    assert s.enc is not None and s.enc.stats.hits > 0 and s.enc.stats.evictions > 0


def test_a_miss_never_evicts_an_item_the_same_chunk_reads() -> None:
    """ "b" is the least recently used item, but the chunk that misses "a" also reads "b": the
    room comes from "c" instead."""
    s = make_scheduler(encoder_cache_size=100)
    s.add_request(make_request(80, max_tokens=1, mm_ranges=[mm(10, 60, "b")]))
    finish_prefill(s)
    s.add_request(make_request(80, max_tokens=1, mm_ranges=[mm(10, 30, "c")]))
    finish_prefill(s)
    r = make_request(140, max_tokens=1, mm_ranges=[mm(10, 40, "a"), mm(60, 60, "b")])
    s.add_request(r)
    t, _ = step(s)
    assert chunks(t) == [(0, 140)]
    assert t.encoder_drops == ["c"]
    assert s.enc is not None and set(s.enc.items) == {"a", "b"}
    assert (s.enc.stats.hits, s.enc.stats.misses) == (1, 3)
