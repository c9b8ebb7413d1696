"""Scheduler scenarios (docs/ARCHITECTURE.md section 4), re-expressed from the peers' public scheduler tests."""

import pytest

from kvsched.core import (
    CapacityExceeded,
    FinishReason,
    InvalidRequest,
    RequestNotFound,
    RequestStatus,
    Scheduler,
    Tasks,
)
from kvsched.core.scheduler.validation import token_ids_in_range
from kvsched.core.slots import set_output
from tests.core.factories import (
    make_request,
    make_requests,
    make_scheduler,
    mm,
    report,
    run_tasks,
    step,
)


def chunk_sizes(tasks) -> list[int]:
    return [len(c.token_ids) for c in tasks.chunks]


def test_long_prefill_cap_splits_three_800_token_prompts() -> None:
    s = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    reqs = make_requests(3, 800, max_tokens=8)
    for r in reqs:
        s.add_request(r)
    t1, _ = step(s)
    assert chunk_sizes(t1) == [400, 400, 224]
    t2, _ = step(s)
    assert chunk_sizes(t2) == [400, 400, 224]
    t3, _ = step(s)
    assert chunk_sizes(t3) == [352]  # the rest of the third; the first two now decode
    assert all(r.num_output_tokens >= 1 for r in reqs)


def test_disable_chunked_prefill_admits_only_whole_prompts() -> None:
    s = make_scheduler(
        max_num_batched_tokens=1000, max_model_len=1000, disable_chunked_prefill=True
    )
    a, b = make_request(600, max_tokens=4), make_request(600, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    t1, _ = step(s)
    assert chunk_sizes(t1) == [600]  # b does not fit whole into the remaining 400
    t2, _ = step(s)
    assert chunk_sizes(t2) == [600]


def test_multimodal_chunk_rolls_back_to_the_image_start() -> None:
    s = make_scheduler(max_num_batched_tokens=60, disable_chunked_mm_input=True)
    r = make_request(100, max_tokens=2, mm_ranges=[mm(40, 40)])
    s.add_request(r)
    t1, _ = step(s)
    assert [(c.start, len(c.token_ids)) for c in t1.chunks] == [(0, 40)]  # not 60: inside image
    t2, _ = step(s)
    assert [(c.start, len(c.token_ids)) for c in t2.chunks] == [(40, 60)]  # image + the rest


def test_multimodal_chunked_input_allowed_by_default() -> None:
    s = make_scheduler(max_num_batched_tokens=60)
    r = make_request(100, max_tokens=2, mm_ranges=[mm(40, 40)])
    s.add_request(r)
    t1, _ = step(s)
    assert chunk_sizes(t1) == [60]


def test_encoder_budget_limits_image_tokens_per_step() -> None:
    s = make_scheduler(max_num_batched_tokens=200, max_num_encoder_tokens=50)
    a = make_request(100, max_tokens=2, mm_ranges=[mm(10, 40, "a")])
    b = make_request(100, max_tokens=2, mm_ranges=[mm(10, 40, "b")])
    s.add_request(a)
    s.add_request(b)
    t1, _ = step(s)
    # a uses 40 encoder tokens; b's image would exceed 50, so b stops before its image.
    assert chunk_sizes(t1) == [100, 10]


def test_image_larger_than_budget_is_rejected_up_front() -> None:
    s = make_scheduler(max_num_batched_tokens=60, disable_chunked_mm_input=True)
    with pytest.raises(InvalidRequest, match="multimodal item of 80 tokens"):
        s.add_request(make_request(100, mm_ranges=[mm(10, 80)]))


def test_priority_order_then_arrival() -> None:
    s = make_scheduler(policy="priority")
    prios, arrivals = [2, 1, 1, 0], [1, 3, 2, 4]
    reqs = [
        make_request(16, req_id=f"p{i}", priority=p, arrival_time=float(a))
        for i, (p, a) in enumerate(zip(prios, arrivals, strict=True))
    ]
    for r in reqs:
        s.add_request(r)
    tasks = s.schedule()
    assert [p.req_id for p in tasks.placements] == ["p3", "p2", "p1", "p0"]


def test_fcfs_order() -> None:
    s = make_scheduler(max_num_seqs=2)
    reqs = make_requests(3, 16)
    for r in reqs:
        s.add_request(r)
    tasks = s.schedule()
    assert [p.req_id for p in tasks.placements] == [reqs[0].req_id, reqs[1].req_id]


def _fill_to_preemption(s, reqs):
    for r in reqs:
        s.add_request(r)
    for _ in range(200):
        tasks, events = step(s)
        if tasks.preempts:
            return tasks, events
    raise AssertionError("no preemption happened")


def test_lifo_preemption_frees_blocks_and_requeues_at_head_on_ack() -> None:
    s = make_scheduler(
        block_size=16, num_gpu_blocks=12, max_num_seqs=3, prealloc_threshold=2, prealloc_blocks=1
    )
    a, b = make_request(40, max_tokens=200), make_request(40, max_tokens=200)
    late = make_request(40, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    for _ in range(200):
        tasks = s.schedule()
        if tasks.preempts:
            break
        run_tasks(s, tasks)
        s.check_integrity()
    else:
        raise AssertionError("no preemption")
    assert tasks.preempts == [b.handle], "the latest admitted request is the victim"
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == []
    s.add_request(late)  # arrives while b waits for its ack
    tokens_before = b.num_output_tokens
    # A report for a step the worker ran before it saw the preempt still delivers b's token.
    ev = s.apply_report(report(s, [(b.handle, b.num_tokens, [5])]))
    assert b.num_output_tokens == tokens_before + 1 and b in ev.token_reqs
    s.apply_report(report(s, [], acked=[b.handle]))
    assert b.status == RequestStatus.WAITING
    assert s.waiting.peek() is b, "a preempted request goes back to the head of the queue"
    s.check_integrity()
    assert b.num_preemptions == 1 and s.stats.num_preemptions == 1


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=8, prealloc_threshold=2, prealloc_blocks=1)
    a, b = make_request(40, max_tokens=200), make_request(40, max_tokens=200)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.add_request(make_request(8, max_tokens=2))
    for _ in range(200):
        tasks = s.schedule()
        if tasks.preempts:
            assert not tasks.placements
            return
        run_tasks(s, tasks)
    raise AssertionError("no preemption")


def test_max_preemptions_spares_a_request_and_counts_it() -> None:
    s = make_scheduler(
        block_size=16, num_gpu_blocks=12, prealloc_threshold=2, prealloc_blocks=1, max_preemptions=1
    )
    a, b, c = (make_request(40, max_tokens=300) for _ in range(3))
    for r in (a, b, c):
        s.add_request(r)
    seen = []
    for _ in range(600):
        tasks, _ = step(s)
        seen += [s.live[h].req_id if h in s.live else h for h in tasks.preempts]
        if all(r.is_finished for r in (a, b, c)):
            break
    assert all(r.num_preemptions <= 1 for r in (a, b, c)) or s.stats.num_preemption_skips > 0


def test_abort_waiting_and_running() -> None:
    s = make_scheduler(max_num_seqs=1)
    run, wait = make_request(32, max_tokens=50), make_request(32, max_tokens=50)
    s.add_request(run)
    s.add_request(wait)
    step(s)
    step(s)
    free_before = s.kv.num_free_blocks
    s.abort(wait.req_id)
    assert wait.status == RequestStatus.FINISHED_ABORTED and len(s.waiting) == 0
    handle = run.handle
    s.abort(run.req_id)
    assert run.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks > free_before and run.block_ids == []
    tasks = s.schedule()
    assert tasks.aborts == [handle]
    # The worker's report of a step it ran before seeing the abort is dropped, not streamed.
    ev = s.apply_report(report(s, [(handle, 40, [9])]))
    assert run not in ev.token_reqs and run.num_output_tokens == 2
    s.apply_report(report(s, [], acked=[handle]))
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    with pytest.raises(RequestNotFound):
        s.abort(run.req_id)


def test_finish_and_abort_crossing_end_the_request_once() -> None:
    s = make_scheduler()
    r = make_request(16, max_tokens=10)
    s.add_request(r)
    step(s)
    s.abort(r.req_id)  # the daemon sees the abort first
    ev = s.apply_report(report(s, [(r.handle, r.num_tokens, [3])], finish={r.handle: 1}))
    assert r.status == RequestStatus.FINISHED_ABORTED and ev.finished == [r]
    assert r.output_token_ids == [7], "tokens after the abort are not kept"
    assert s.stats.num_finished == {FinishReason.ABORT: 1}


def test_worker_finish_is_final_and_frees_blocks() -> None:
    s = make_scheduler()
    r = make_request(16, max_tokens=10)
    s.add_request(r)
    step(s)
    ev = s.apply_report(report(s, [(r.handle, r.num_tokens, [3])], finish={r.handle: 1}))
    assert r in ev.finished and r.finish_reason == FinishReason.STOP
    assert r.output_token_ids == [7, 3]
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_max_tokens_enforced_even_if_worker_overshoots() -> None:
    s = make_scheduler()
    r = make_request(16, max_tokens=2)
    s.add_request(r)
    step(s)
    ev = s.apply_report(report(s, [(r.handle, r.num_tokens, [3, 4, 5])]))
    assert r.output_token_ids == [7, 3] and r.finish_reason == FinishReason.LENGTH
    assert r in ev.finished


def test_decode_extension_by_prealloc_threshold() -> None:
    s = make_scheduler(block_size=16, prealloc_blocks=2, prealloc_threshold=4)
    r = make_request(20, max_tokens=100)
    s.add_request(r)
    t, _ = step(s)
    # 20 prompt + 1 first decode + 4 threshold -> 25 positions -> 2 blocks.
    assert len(r.block_ids) == 2
    extensions = []
    for _ in range(30):
        t, _ = step(s)
        extensions += [len(e.block_ids) for e in t.extensions]
        assert r.num_tokens <= len(r.block_ids) * 16, "worker would have run out of room"
    assert extensions and set(extensions) == {2}


def test_reserve_decays_per_step_and_resets_after_preemption() -> None:
    s = make_scheduler(
        block_size=16,
        num_gpu_blocks=14,
        reserve_blocks=4,
        reserve_decay=1.0,
        reserve_min=1,
        prealloc_threshold=2,
        prealloc_blocks=1,
    )
    assert s.reserve_blocks_per_running == 4
    a = make_request(40, max_tokens=300)
    s.add_request(a)
    step(s)
    assert s.reserve_blocks_per_running == 3
    step(s)
    step(s)
    step(s)
    assert s.reserve_blocks_per_running == 1  # floor at reserve_min
    b = make_request(40, max_tokens=300)
    s.add_request(b)
    for _ in range(400):
        t, _ = step(s)
        if t.preempts:
            break
    assert t.preempts
    assert s.reserve_blocks_per_running == 4, "a preemption resets the reserve"


def test_reserve_blocks_admission() -> None:
    s = make_scheduler(
        block_size=16,
        num_gpu_blocks=10,
        reserve_blocks=5,
        reserve_decay=0.0,
        reserve_min=5,
        prealloc_threshold=2,
        prealloc_blocks=1,
    )
    a = make_request(40, max_tokens=50)
    s.add_request(a)
    step(s)
    b = make_request(40, max_tokens=50)
    s.add_request(b)
    t = s.schedule()
    # b needs 3 blocks; free 7 < 3 + 5 x 1 running: held back.
    assert not t.placements and b.status == RequestStatus.WAITING


def test_speculative_budget_k_plus_one_and_extra_block() -> None:
    s = make_scheduler(
        block_size=16,
        max_num_batched_tokens=100,
        num_speculative_tokens=3,
        prealloc_blocks=1,
        prealloc_threshold=2,
    )
    a = make_request(20, max_tokens=200)
    s.add_request(a)
    step(s)
    b = make_request(200, max_tokens=4)
    s.add_request(b)
    t, _ = step(s)
    assert chunk_sizes(t) == [100 - 4], "one decoding request costs k + 1 = 4 tokens"
    ext = []
    for _ in range(40):
        t = s.schedule()
        ext += [len(e.block_ids) for e in t.extensions if e.handle == a.handle]
        rows = [(a.handle, a.num_tokens + 1, [1, 2])] if a.status == RequestStatus.RUNNING else []
        s.apply_report(report(s, rows))
        assert a.num_tokens + 3 <= len(a.block_ids) * 16 + 2
        s.check_integrity()
    assert ext and set(ext) == {2}, "prealloc_blocks + one extra block with speculation"


def test_draft_counts_reach_the_request_and_the_counters() -> None:
    """A report's sparse draft columns add each row's verified and accepted drafts to its
    request and the snapshot's counters; a row about a handle no longer live is dropped, and
    an accepted count above the drafts is clamped to them."""
    s = make_scheduler(block_size=16, num_speculative_tokens=3)
    a, b = make_request(20, max_tokens=50), make_request(20, max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    step(s)
    for drafts, accepted in ((3, 2), (3, 0), (3, 5)):
        s.schedule()
        rep = report(s, [(a.handle, a.num_tokens + 1, [1] * (1 + min(accepted, drafts)))])
        rep.draft_handles, rep.num_draft_tokens = [a.handle, 10_000], [drafts, 7]
        rep.num_accepted_drafts = [accepted, 7]
        s.apply_report(rep)
        s.check_integrity()
    assert (a.num_draft_tokens, a.num_accepted_drafts) == (9, 5)
    assert (b.num_draft_tokens, b.num_accepted_drafts) == (0, 0)
    snap = s.snapshot()
    assert (snap.num_draft_tokens, snap.num_accepted_drafts) == (9, 5)


def test_pause_preempts_everything_and_holds_admission() -> None:
    s = make_scheduler()
    reqs = make_requests(3, 20, max_tokens=50)
    for r in reqs:
        s.add_request(r)
    step(s)
    s.pause()
    t, _ = step(s)
    assert sorted(t.preempts) == sorted(r.handle for r in reqs) or all(
        r.status == RequestStatus.WAITING for r in reqs
    )
    t, _ = step(s)
    assert not t.placements and s.num_running == 0
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    s.resume()
    t, _ = step(s)
    assert len(t.placements) == 3
    # recompute from prompt + outputs so far
    assert all(p.num_prefill_tokens == 20 + 1 and p.num_output_tokens == 1 for p in t.placements)


def test_reset_prefix_cache() -> None:
    s = make_scheduler()
    r = make_request(40, max_tokens=1)
    s.add_request(r)
    step(s)
    assert s.kv.pool.cached
    assert s.reset_prefix_cache() > 0 and not s.kv.pool.cached
    assert s.schedule().reset_prefix_cache


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prompt": []}, "prompt_token_ids is empty"),
        ({"max_tokens": 0}, "max_tokens = 0 must be >= 1"),
        ({"prompt": 8000, "max_tokens": 500}, "exceeds max_model_len 8192"),
        ({"prompt": [1, -2]}, "token ids must be in"),
        ({"prompt": [1, 2**31]}, "token ids must be in"),
        ({"prompt": [2**32 + 1, 3]}, "token ids must be in"),
        ({"prompt": [-(2**40)]}, "token ids must be in"),
    ],
)
def test_bad_input_raises_typed_errors_and_changes_nothing(kw, match) -> None:
    s = make_scheduler()
    prompt = kw.pop("prompt", 8)
    with pytest.raises(InvalidRequest, match=match):
        s.add_request(make_request(prompt, **kw))
    assert len(s.waiting) == 0 and not s.requests
    s.check_integrity()


def test_token_ids_range_check_is_min_and_max() -> None:
    """The packed check agrees with 0 <= min and max < 2^31 at the edges, and refuses what is
    not an integer."""
    cases = [
        [0],
        [2**31 - 1, 0, 7],
        [2**31],
        [-1],
        [5, 2**32],
        [2**32 - 1],
        [2**64],
        [3, 2**31 + 1],
    ]
    for ids in cases:
        assert token_ids_in_range(ids) == (min(ids) >= 0 and max(ids) <= 2**31 - 1), ids
    assert not token_ids_in_range([1, 2.0])  # type: ignore[list-item]
    assert token_ids_in_range([True, 5]), "an int subclass is an int"
    s = make_scheduler()
    s.add_request(make_request([0, 2**31 - 1, 5]))
    assert len(s.waiting) == 1


def test_duplicate_id_unknown_abort_and_negative_priority() -> None:
    s = make_scheduler()
    s.add_request(make_request(8, req_id="dup"))
    with pytest.raises(InvalidRequest, match="already in use"):
        s.add_request(make_request(8, req_id="dup"))
    with pytest.raises(RequestNotFound, match="no live request"):
        s.abort("nope")
    p = make_scheduler(policy="priority")
    with pytest.raises(InvalidRequest, match="priority = -1"):
        p.add_request(make_request(8, priority=-1))
    assert len(s.waiting) == 1


def test_queue_full_is_capacity_exceeded() -> None:
    s = make_scheduler(max_waiting=2)
    s.add_request(make_request(8))
    s.add_request(make_request(8))
    with pytest.raises(CapacityExceeded, match="waiting queue is full"):
        s.add_request(make_request(8))


def test_step_cost_ignores_the_waiting_queue() -> None:
    # With no slot free, schedule() must not walk the queue: the head is never even peeked
    # past. (Timing is measured by bench.core_step; this checks the structure.)
    s = make_scheduler(max_num_seqs=1)
    for r in make_requests(50, 8, max_tokens=100):
        s.add_request(r)
    step(s)
    before = [r.block_hashes for r in s.waiting]
    step(s)
    assert all(not h for h in before), "waiting requests were hashed without being admitted"


def test_prompt_larger_than_the_pool_nan_sampling_and_overlapping_images_are_rejected() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=10)
    with pytest.raises(InvalidRequest, match="needs 11 KV blocks but the instance has 10"):
        s.add_request(make_request(160))
    bad = make_request(8)
    bad.sampling.temperature = float("nan")
    with pytest.raises(InvalidRequest, match="finite"):
        s.add_request(bad)
    with pytest.raises(InvalidRequest, match="must not overlap"):
        s.add_request(make_request(100, mm_ranges=[mm(0, 40, "a"), mm(10, 40, "b")]))
    assert not s.requests


def test_a_lone_request_never_asks_for_more_blocks_than_it_can_use() -> None:
    # The pool holds exactly prompt + max_tokens - 1 positions: the request must finish.
    s = make_scheduler(
        block_size=4, num_gpu_blocks=12, max_model_len=48, prealloc_blocks=1, prealloc_threshold=2
    )
    r = make_request(20, max_tokens=28)
    s.add_request(r)
    for _ in range(60):
        step(s)
    assert r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 28
    assert r.num_preemptions == 0 and s.kv.num_free_blocks == 12
    late = make_request(4, max_tokens=2)
    s.add_request(late)
    for _ in range(5):
        step(s)
    assert late.is_finished


def test_a_lone_request_that_outgrows_the_pool_ends_with_length_not_a_livelock() -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=8, prealloc_blocks=1, prealloc_threshold=0)
    r = make_request(20, max_tokens=100)  # 120 positions, the pool holds 32
    s.add_request(r)
    handle, sent_aborts = -1, []
    for _ in range(40):
        handle = r.handle if r.handle >= 0 else handle
        tasks, _ = step(s)
        sent_aborts += tasks.aborts
    assert r.finish_reason == FinishReason.LENGTH and "KV cache full" in r.finish_message
    assert s.kv.num_free_blocks == 8 and r.num_preemptions == 0
    assert sent_aborts == [handle], "the worker must be told to drop the ended request"


def test_reset_prefix_cache_while_blocks_are_shared_keeps_integrity() -> None:
    s = make_scheduler(block_size=4, num_gpu_blocks=64)
    p = list(range(100, 108))
    a = make_request([*p, 1], max_tokens=50)
    s.add_request(a)
    step(s)
    b = make_request([*p, 2], max_tokens=50)
    s.add_request(b)
    step(s)
    assert a.block_ids[:2] == b.block_ids[:2]
    s.reset_prefix_cache()
    s.check_integrity()
    step(s)


def _run_lagging_worker(lag: int, cycles: int) -> tuple[Scheduler, list[int]]:
    """A real sim worker that runs `lag` steps per scheduler cycle (its reports merged into
    one, as the worker client sends them) and gets each Tasks one cycle late. Returns the
    scheduler and the paused rows of each cycle."""
    from kvsched.worker_stub.engine import WorkerEngine
    from kvsched.worker_stub.sim import SimExecutor
    from tests.core.test_state_machine import merge_reports

    sched = make_scheduler(num_gpu_blocks=4000, max_num_seqs=8)
    for i in range(8):
        sched.add_request(make_request(8, max_tokens=4000, req_id=f"r{i}"))
    worker = WorkerEngine(SimExecutor(zero_cost=True), 16, 8, 2, 1 << 20, columnar=True)
    late: list[Tasks] = []
    paused = []
    for _ in range(cycles):
        late.append(sched.schedule())
        if len(late) > 1:
            worker.apply(late.pop(0))
        merged, n_paused = None, 0
        for _ in range(lag):
            rep = worker.step()
            if rep is None:
                break
            n_paused += len(rep.paused)
            merged = rep if merged is None else merge_reports(merged, rep)
        if merged is not None:
            sched.apply_report(merged)
        paused.append(n_paused)
        sched.check_integrity()
    return sched, paused


def test_decode_headroom_follows_the_workers_round_trip() -> None:
    """A worker many steps ahead of the scheduler would pause its slots for every extension
    with the configured 12-token threshold; the headroom grows to what it decodes in one
    round trip, and its slots stop pausing. A prompt worker keeps the configured one."""
    sched, paused = _run_lagging_worker(lag=20, cycles=60)
    assert sched.decode_headroom >= 20
    assert sum(paused[:10]) > 0, "the lagging worker paused before the headroom grew"
    assert sum(paused[-30:]) == 0
    sched, paused = _run_lagging_worker(lag=1, cycles=60)
    assert sched.decode_headroom == sched.config.cache.prealloc_threshold
    assert sum(paused) == 0


def test_a_merged_report_longer_than_the_token_ring_keeps_every_token() -> None:
    """A worker far ahead of the scheduler sends one report with a handle in 300 consecutive
    steps, more than a slot's token ring holds between two visits: every token arrives, in
    order, once, and the request is visited once."""
    from kvsched.core.slots import RING

    s = make_scheduler(prealloc_threshold=400)
    req = make_request(8, max_tokens=1000)
    s.add_request(req)
    tasks = s.schedule()
    h = tasks.placements[0].handle
    s.apply_report(report(s, [(h, 8, [100])]))  # the prompt, and the first token
    n = RING + 44
    toks = list(range(1000, 1000 + n))
    ev = s.apply_report(report(s, [(h, 8 + i, [t]) for i, t in enumerate(toks, 1)]))
    assert req.output_token_ids == [100, *toks]
    streamed = [t for a, slots, ts in ev.tokens for t in (ts.tolist() if slots is not None else ts)]
    assert streamed == toks
    s.check_integrity()


def test_output_block_hashes_read_from_the_ring_equal_hashing_the_tokens() -> None:
    """Decoded output blocks are hashed from the slot's token ring; the chain must be the one
    hashing the request's token list gives (else a later prompt repeating them would miss)."""
    from kvsched.core import Request

    sched, _ = _run_lagging_worker(lag=3, cycles=150)
    checked = 0
    for req in sched.running.values():
        assert len(req.block_hashes) > 2  # prompt block and decoded blocks
        copy = Request("copy", req.prompt_token_ids)
        set_output(copy, list(req.output_token_ids))
        sched.kv.ensure_hashes(copy, len(req.block_hashes))
        assert copy.block_hashes == req.block_hashes
        checked += 1
    assert checked == 8


@pytest.mark.parametrize("ending", ["abort", "finish"])
def test_an_extension_made_by_a_report_is_not_sent_for_a_request_that_ended_before_the_step(
    ending: str,
) -> None:
    # A report visit extends a decoding request at once (the Extension waits for the next
    # Tasks). If the request ends before that schedule(), its blocks went back with it: the
    # Tasks must not hand them to its old handle.
    s = make_scheduler(block_size=16, prealloc_blocks=2, prealloc_threshold=4)
    r, other = make_request(20, max_tokens=100), make_request(20, max_tokens=100)
    s.add_request(r)
    s.add_request(other)
    step(s)
    blocks = len(r.block_ids)
    while len(r.block_ids) == blocks:  # decode until a report visit extends r
        tasks = s.schedule()
        assert not any(e.handle == r.handle for e in tasks.extensions)
        run_tasks(s, tasks)
        s.check_integrity()
    handle = r.handle
    if ending == "abort":
        s.abort(r.req_id)
    else:
        s.apply_report(report(s, [(handle, r.num_tokens, [3])], finish={handle: 1}))
    assert r.is_finished and r.block_ids == []
    tasks = s.schedule()
    assert all(e.handle != handle for e in tasks.extensions)
    s.check_integrity()
    run_tasks(s, tasks)
    s.abort(other.req_id)
    s.apply_report(report(s, [], acked=s.schedule().aborts))
    s.check_integrity()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_an_extension_made_by_a_report_goes_out_with_the_next_tasks() -> None:
    s = make_scheduler(block_size=16, prealloc_blocks=2, prealloc_threshold=4)
    r = make_request(20, max_tokens=100)
    s.add_request(r)
    step(s)
    blocks = list(r.block_ids)
    while r.block_ids == blocks:
        step(s)
    new = r.block_ids[len(blocks) :]
    tasks = s.schedule()
    assert [(e.handle, e.block_ids) for e in tasks.extensions] == [(r.handle, new)]
    assert not s.schedule().extensions, "sent once"


def _decoding(n: int = 2):
    s = make_scheduler()
    reqs = make_requests(n, 20, max_tokens=50)
    for r in reqs:
        s.add_request(r)
    step(s)
    step(s)
    return s, reqs


@pytest.mark.parametrize("as_arrays", [False, True])
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_new_tokens=[1, -1]), "negative token count"),
        (dict(token_ids=[5]), "token_ids length"),
        (dict(num_computed=[22]), "differ in length"),
        (dict(finish_reasons=[0, 9]), "unknown finish reason"),
        (dict(finish_reasons=[0]), "finish_reasons must be empty or one per handle"),
        (dict(handles="unissued"), "never issued"),
        (dict(handles="minus_one"), "never issued"),  # -1 is what an empty slot holds
        (dict(paused=[2**64 - 1]), "not a 64-bit integer"),
        (dict(step="same"), "steps must increase"),
        (dict(applied_seq=99), "applied tasks 99"),
    ],
)
def test_a_report_that_breaks_the_protocol_is_refused_and_changes_nothing(
    change, match, as_arrays
) -> None:
    import dataclasses

    import numpy as np

    from kvsched.core import ProtocolError

    s, reqs = _decoding()
    good = report(s, [(r.handle, r.num_tokens, [5]) for r in reqs])
    fields = dict(change)
    if fields.get("handles") == "unissued":
        fields["handles"] = [reqs[0].handle, s.next_handle + 64]
    if fields.get("handles") == "minus_one":
        fields["handles"] = [reqs[0].handle, -1]
    if fields.get("step") == "same":
        fields["step"] = s.last_report_step
    bad = dataclasses.replace(good, **fields)
    if as_arrays:
        for name in ("handles", "num_computed", "num_new_tokens", "token_ids", "finish_reasons"):
            setattr(bad, name, np.asarray(getattr(bad, name), dtype=np.int64))
    before = [(r.output_token_ids.copy(), list(r.block_ids), r.status) for r in reqs]
    with pytest.raises(ProtocolError, match=match):
        s.apply_report(bad)
    assert [(r.output_token_ids, r.block_ids, r.status) for r in reqs] == before
    s.check_integrity()
    s.apply_report(good)  # the scheduler goes on as if the bad report never came
    assert all(r.output_token_ids[-1] == 5 for r in reqs)


@pytest.mark.parametrize("as_arrays", [False, True])
def test_a_finish_reason_in_a_column_of_zeros_finishes_only_that_request(as_arrays) -> None:
    import numpy as np

    s, (a, b) = _decoding()
    rep = report(s, [(a.handle, a.num_tokens, [5]), (b.handle, b.num_tokens, [6])])
    rep.finish_reasons = [0, int(FinishReason.STOP)]
    if as_arrays:
        rep.finish_reasons = np.asarray(rep.finish_reasons, dtype=np.int64)
    ev = s.apply_report(rep)
    assert ev.finished == [b] and b.finish_reason == FinishReason.STOP
    assert a.status == RequestStatus.RUNNING and a.output_token_ids[-1] == 5
    s.check_integrity()


def test_a_slot_paused_while_its_extension_is_on_the_way_gets_no_second_one() -> None:
    # A merged report visits the request (room low: extended at once), and the same report
    # says its slot paused (the worker filled it before the extension arrived). One extension
    # must go out; with a pool that holds exactly one more, a second would end the request.
    from kvsched.core import StepReport

    s = make_scheduler(block_size=16, prealloc_blocks=2, prealloc_threshold=0, num_gpu_blocks=4)
    r = make_request(20, max_tokens=100)
    s.add_request(r)
    step(s)
    while r.num_output_tokens < 11:
        assert not s.schedule().extensions
        s.apply_report(report(s, [(r.handle, r.num_tokens, [7])]))
    s.schedule()
    h = r.handle
    s.apply_report(
        StepReport(
            step=s.last_report_step + 1,
            applied_seq=s.last_tasks_seq,
            handles=[h, h],
            num_computed=[r.num_tokens, r.num_tokens + 1],
            num_new_tokens=[1, 1],
            token_ids=[7, 7],
            paused=[h],
        )
    )
    tasks = s.schedule()
    assert [(e.handle, len(e.block_ids)) for e in tasks.extensions] == [(h, 2)]
    assert not tasks.aborts and r.status == RequestStatus.RUNNING
    s.check_integrity()


def test_a_request_extended_by_a_later_report_is_not_extended_again() -> None:
    # Two reports before one schedule(): at the first the pool is dry (the request waits for
    # blocks), at the second another request's finish freed some and the visit extends it.
    s = make_scheduler(
        block_size=16,
        prealloc_blocks=2,
        prealloc_threshold=4,
        num_gpu_blocks=6,
        num_speculative_tokens=2,
    )
    a, b = make_request(20, max_tokens=200), make_request(20, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    s.schedule()
    for _ in range(50):
        s.apply_report(report(s, [(a.handle, a.num_tokens + 2, [7, 7, 7])]))
        if a.req_id in s.needs_blocks:
            break
        s.schedule()
    assert a.req_id in s.needs_blocks and s.kv.num_free_blocks < 3
    rows = [(a.handle, a.num_tokens + 2, [7, 7, 7]), (b.handle, b.num_tokens, [7])]
    s.apply_report(report(s, rows, finish={b.handle: 1}))
    blocks = len(a.block_ids)
    tasks = s.schedule()
    assert sum(len(e.block_ids) for e in tasks.extensions if e.handle == a.handle) <= blocks
    assert len(a.block_ids) == blocks, "extended once"
    assert not tasks.aborts and not tasks.preempts and a.status == RequestStatus.RUNNING
    s.check_integrity()


@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_the_first_token_is_seen_when_the_pool_is_dry_at_a_chunk_visit(role: str) -> None:
    # Pipelined prefill chunks: a chunk's row arrives when the room is already low and the
    # pool dry (the request waits for blocks); the first token arrives before the next
    # schedule(). It must still be a first-token event (and, on a prefill instance, a hand-off).
    # (A request has at most two chunks in flight, and a worker step's budget counts the
    # chunks sent and not yet run: r's third chunk goes out once its first is reported.)
    s = make_scheduler(
        block_size=16,
        prealloc_threshold=2,
        num_gpu_blocks=4,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        role=role,
    )
    s.outbox.threshold = 12  # as after a measured round trip of 12 worker steps
    r, d = make_request(40, max_tokens=20), make_request(8, max_tokens=20)
    if role == "prefill":
        r.kv_target = d.kv_target = ("d0", 99, [0, 1, 2, 3])
    s.add_request(r)
    for _ in range(2):
        s.schedule()  # r's first two chunks in flight
    s.add_request(d)
    s.schedule()  # d admitted beside them
    h = r.handle
    s.apply_report(report(s, [(h, 16, [])]))
    s.schedule()  # r's last chunk takes the last blocks
    assert s.kv.num_free_blocks == 0 and r.num_computed_tokens == 40
    s.apply_report(report(s, [(h, 32, [])]))
    ev = s.apply_report(report(s, [(h, 40, [5])]))
    assert ev.first_token == [r] and r.first_token_time >= 0
    if role == "prefill":
        assert ev.handed_off == [r]
    s.check_integrity()
