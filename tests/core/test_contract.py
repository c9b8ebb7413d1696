"""Core halves of the worker contract (protos/kvsched/v1/worker_service.proto): Tasks.seq
numbers exactly the messages worth sending, a placement with prefill left carries
last_token_id -1, and a preempted request counts as running until its worker acknowledges."""

from __future__ import annotations

from tests.core.factories import make_request, make_scheduler, report, run_tasks, step


def test_tasks_seq_numbers_only_messages_worth_sending() -> None:
    s = make_scheduler()
    idle = s.schedule()  # nothing to do, no report to answer: not sent, not numbered
    assert idle.is_empty() and idle.seq == 0 and s.last_tasks_seq == 0
    s.add_request(make_request(20, max_tokens=4))
    first = s.schedule()
    assert first.placements and first.seq == 1
    assert s.schedule().seq == 0  # nothing new, and no report since the last message
    run_tasks(s, first)  # a report: the next message answers it even with no task
    answer = s.schedule()
    assert answer.is_empty() and answer.seq == 2
    assert s.schedule().seq == 0
    seqs = [first.seq, answer.seq]
    for _ in range(6):
        tasks, _ = step(s)
        if tasks.seq:
            seqs.append(tasks.seq)
    assert seqs == list(range(1, len(seqs) + 1))


def test_recompute_placement_has_no_last_token() -> None:
    s = make_scheduler()
    req = make_request(20, max_tokens=50)
    s.add_request(req)
    for _ in range(4):
        step(s, token=42)
    assert req.num_output_tokens >= 2 and req.is_prefill_done
    s.pause()
    tasks = s.schedule()
    assert tasks.preempts == [req.handle]
    run_tasks(s, tasks)  # acknowledged: back in the queue
    s.resume()
    tasks = s.schedule()
    (p,) = tasks.placements
    assert p.num_cached_tokens < p.num_prefill_tokens == 20 + req.num_output_tokens
    assert p.last_token_id == -1


def test_preempted_request_counts_as_running_until_acknowledged() -> None:
    s = make_scheduler()
    req = make_request(20, max_tokens=50)
    s.add_request(req)
    step(s)
    step(s)
    s.pause()
    tasks = s.schedule()
    assert tasks.preempts == [req.handle]
    snap = s.snapshot()
    assert (snap.num_running, snap.num_waiting) == (1, 0)
    s.apply_report(report(s, acked=[req.handle]))
    snap = s.snapshot()
    assert (snap.num_running, snap.num_waiting) == (0, 1)
