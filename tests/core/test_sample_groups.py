"""Samples of one prompt (`sample_group`, kvsched/core/scheduler/groups.py): the first computes
the prompt, the others wait for it, then share its full blocks by reference count and compute
only the tail. Integrity is checked after every step (`step`)."""

from __future__ import annotations

from kvsched.core import FinishReason, Request, RequestStatus, Scheduler
from tests.core.factories import make_request, make_scheduler, run_tasks, step

BS = 16
PROMPT = list(range(3000, 3000 + 1000))  # 62 full blocks + 8 tokens
FULL = len(PROMPT) // BS


def samples(n: int, group: str = "g", prompt: list[int] = PROMPT, **kw: object) -> list[Request]:
    return [
        make_request(list(prompt), req_id=f"{group}-{i}", sample_group=group, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


def prompt_tokens_sent(tasks_list: list) -> int:  # type: ignore[type-arg]
    return sum(len(c.token_ids) for t in tasks_list for c in t.chunks)


def run_until(s: Scheduler, cond, limit: int = 200) -> list:  # type: ignore[no-untyped-def,type-arg]
    sent = []
    for _ in range(limit):
        if cond():
            return sent
        tasks, _ = step(s)
        sent.append(tasks)
    raise AssertionError("condition not reached")


def test_eight_samples_compute_the_prompt_once_and_hold_its_blocks_once() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    group = samples(8, max_tokens=20)
    for r in group:
        s.add_request(r)
        s.check_integrity()
    leader, members = group[0], group[1:]
    assert s.num_waiting == 1 and s.num_held == 7  # only the leader is queued
    assert s.snapshot().num_waiting == 8  # status shows the held ones as waiting
    # Until the leader's first token is reported, no member is placed.
    sent = run_until(s, lambda: bool(leader.output_token_ids))
    assert all(r.status == RequestStatus.WAITING and r.handle < 0 for r in members)
    assert {p.req_id for t in sent for p in t.placements} == {leader.req_id}
    assert s.num_held == 0 and s.num_waiting == 7  # released with the first token
    sent += run_until(s, lambda: all(r.output_token_ids for r in members))
    # The prompt was sent once in full; each member sent only its tail (8 tokens here).
    tail = len(PROMPT) - FULL * BS
    assert prompt_tokens_sent(sent) == len(PROMPT) + 7 * tail
    for r in members:
        assert r.num_cached_tokens == FULL * BS
        assert r.block_ids[:FULL] == leader.block_ids[:FULL]
    pool = s.kv.pool
    assert all(pool.ref_cnt[b] == 8 for b in leader.block_ids[:FULL])
    # Held once: the prompt's full blocks, plus each sample's own tail and decode blocks.
    owned = {b for r in group for b in r.block_ids}
    assert len(owned) == FULL + sum(len(r.block_ids) - FULL for r in group)
    assert len(owned) < 2 * FULL  # (n separate prefills would hold 8 x 63 blocks)
    run_until(s, lambda: all(r.is_finished for r in group))
    assert all(r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 20 for r in group)
    assert pool.num_free == pool.num_blocks  # every block returned


def test_members_released_by_the_leaders_first_token_even_when_it_finishes_with_it() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=2048)
    leader = make_request(PROMPT, max_tokens=1, req_id="l", sample_group="g")
    member = make_request(PROMPT, max_tokens=4, req_id="m", sample_group="g")
    s.add_request(leader)
    s.add_request(member)
    step(s)  # the whole prompt in one chunk; its first token ends it
    assert leader.is_finished and member.status == RequestStatus.WAITING
    tasks, _ = step(s)
    (pl,) = tasks.placements
    assert pl.req_id == "m" and pl.num_cached_tokens == FULL * BS  # from the freed cache


def test_aborted_leader_hands_its_lead_to_the_first_member_held() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    a, b, c = samples(3, max_tokens=4)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a has computed a chunk
    s.abort(a.req_id)
    s.check_integrity()
    assert a.is_finished and s.num_held == 1 and s.num_waiting == 1
    sent = run_until(s, lambda: bool(b.output_token_ids))
    assert c.handle < 0 and c.status == RequestStatus.WAITING  # still held, now on b
    assert {p.req_id for t in sent for p in t.placements} == {b.req_id}
    run_until(s, lambda: bool(c.output_token_ids))
    assert c.num_cached_tokens == FULL * BS
    run_until(s, lambda: b.is_finished and c.is_finished)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_abort_of_a_held_member_ends_it_at_once_and_the_group_goes_on() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    a, b, c = samples(3, max_tokens=4)
    for r in (a, b, c):
        s.add_request(r)
    s.abort(b.req_id)
    s.check_integrity()
    assert b.finish_reason == FinishReason.ABORT and s.num_held == 1
    run_until(s, lambda: a.is_finished and c.is_finished)
    assert b.handle < 0 and c.num_cached_tokens == FULL * BS
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_aborting_the_whole_group_returns_every_block() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    group = samples(4, max_tokens=30)
    for r in group:
        s.add_request(r)
    run_until(s, lambda: all(r.output_token_ids for r in group))
    for r in group:
        s.abort(r.req_id)
        s.check_integrity()
    run_tasks(s, s.schedule())  # the worker acknowledges the aborts
    s.check_integrity()
    assert all(r.finish_reason == FinishReason.ABORT for r in group)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_preempted_leader_keeps_its_members_held_until_it_recomputes_the_prompt() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=256, num_gpu_blocks=200)
    a, b = samples(2, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert a.status == RequestStatus.RUNNING and not a.output_token_ids
    s.pause()  # preempts everything running (rule 11)
    s.check_integrity()
    run_tasks(s, s.schedule())  # acknowledged: a waits again
    s.check_integrity()
    assert a.status == RequestStatus.WAITING and b.status == RequestStatus.WAITING
    assert s.num_held == 1
    s.resume()
    sent = run_until(s, lambda: bool(a.output_token_ids))
    assert b.handle < 0 and {p.req_id for t in sent for p in t.placements} == {a.req_id}
    run_until(s, lambda: bool(b.output_token_ids))
    assert b.num_cached_tokens == FULL * BS
    run_until(s, lambda: a.is_finished and b.is_finished)


def test_preempted_member_recomputes_alone_and_ends() -> None:
    # A pool the group barely fits: decode growth preempts a member (LIFO), which recomputes.
    s = make_scheduler(
        block_size=BS, max_num_batched_tokens=256, num_gpu_blocks=FULL + 12, reserve_blocks=0
    )
    group = samples(4, max_tokens=60)
    for r in group:
        s.add_request(r)
    run_until(s, lambda: all(r.is_finished for r in group), limit=2000)
    assert sum(r.num_preemptions for r in group) > 0
    assert all(r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 60 for r in group)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_other_prompts_other_groups_and_short_prompts_are_not_held() -> None:
    s = make_scheduler(block_size=BS)
    a = make_request(PROMPT, req_id="a", sample_group="g")
    other = make_request(PROMPT[:-1] + [1], req_id="o", sample_group="g")  # same key, other prompt
    salted = make_request(PROMPT, req_id="s", sample_group="g", cache_salt="x")
    h = make_request(PROMPT, req_id="h", sample_group="h")  # another group
    short = samples(2, group="short", prompt=list(range(10)))
    for r in (a, other, salted, h, *short):
        s.add_request(r)
        s.check_integrity()
    assert s.num_held == 0 and s.num_waiting == 6
    assert s.leads_group("g") and s.leads_group("h") and not s.leads_group("short")


def test_no_grouping_without_prefix_caching_or_on_a_prefill_instance() -> None:
    for kw in ({"enable_prefix_caching": False}, {"role": "prefill"}):
        s = make_scheduler(block_size=BS, **kw)  # type: ignore[arg-type]
        for r in samples(3):
            s.add_request(r)
        s.check_integrity()
        assert s.num_held == 0 and s.num_waiting == 3 and not s.leads_group("g")


def test_a_late_member_after_the_leaders_first_token_queues_and_hits_the_cache() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=2048)
    a, b = samples(2, max_tokens=8)
    s.add_request(a)
    run_until(s, lambda: bool(a.output_token_ids))
    assert not s.leads_group("g")  # the group's prompt is computed: nothing to wait for
    s.add_request(b)
    s.check_integrity()
    assert s.num_held == 0
    tasks, _ = step(s)
    assert [p.num_cached_tokens for p in tasks.placements] == [FULL * BS]


def test_a_held_sample_is_judged_by_its_tail_when_deadlines_shed() -> None:
    """Shedding (rule 12) predicts a held sample's wait as its leader's prefill (queued ahead)
    plus its own tail: a deadline that this meets keeps the sample; an ungrouped copy, which
    would prefill the whole prompt after the leader's, is shed."""
    from kvsched.core import CapacityExceeded
    from kvsched.core.config import ShedPolicy

    s = make_scheduler(block_size=BS, max_num_batched_tokens=256)
    s.config.fairness.shed = ShedPolicy.SHED
    leader = make_request(PROMPT, req_id="l", sample_group="g")
    s.add_request(leader)
    whole = s.backlog.predicted_prefill_ms(leader, 0)
    tail = s.backlog.predicted_prefill_ms(leader, FULL * BS)
    deadline = (3 * whole + tail) / 2  # between whole + tail and whole + whole
    member = make_request(PROMPT, req_id="m", sample_group="g", ttft_deadline_ms=deadline)
    s.add_request(member)
    s.check_integrity()
    assert s.num_held == 1 and s.num_shed == 0
    alone = make_request(PROMPT, req_id="a", ttft_deadline_ms=deadline)
    try:
        s.add_request(alone)
    except CapacityExceeded:
        pass
    else:
        raise AssertionError("a copy outside the group should have been shed")
    assert s.num_shed == 1
    s.check_integrity()


def test_held_samples_count_against_max_waiting() -> None:
    from kvsched.core import CapacityExceeded

    s = make_scheduler(block_size=BS, max_waiting=3)
    a, b, c, d = samples(4)
    for r in (a, b, c):
        s.add_request(r)
    assert s.num_waiting == 1 and s.num_held == 2
    try:
        s.add_request(d)
    except CapacityExceeded as exc:
        assert "max_waiting" in str(exc)
    else:
        raise AssertionError("a fourth waiting request past max_waiting 3 was accepted")
    s.check_integrity()
    assert s.num_held == 2 and d.req_id not in s.requests
