"""Prefill/decode hand-off (scheduling rule 10, docs/ARCHITECTURE.md) and the router."""

import ast
import pathlib

import pytest

import kvsched.core
from kvsched.core import FinishReason, ProtocolError, RequestNotFound, RequestStatus, Router
from tests.core.factories import make_request, make_scheduler, report, run_tasks, step


def test_prefill_decode_hand_off() -> None:
    p = make_scheduler(role="prefill", instance_id="P")
    d = make_scheduler(role="decode", instance_id="D")
    req = make_request(40, max_tokens=5)
    handle, blocks = d.preallocate(req)
    assert len(blocks) * 16 >= 41 and d.kv.num_free_blocks == d.kv.pool.num_blocks - len(blocks)
    t_d = d.schedule()
    assert [pl.handle for pl in t_d.placements] == [handle] and not t_d.chunks  # idle reservation
    req.kv_target = ("D", handle, blocks)
    p.add_request(req)
    t_p = p.schedule()
    (send,) = t_p.kv_sends
    assert (send.dst_instance, send.dst_handle, send.dst_block_ids) == ("D", handle, blocks)
    ev = run_tasks(p, t_p, token=11)
    assert ev.handed_off == [req] and not ev.finished
    assert p.kv.num_free_blocks == p.kv.pool.num_blocks and not p.requests
    p.check_integrity()
    # The decode side continues from the first token on the same blocks, new handle.
    dreq = d.add_prefilled(req.req_id, req.output_token_ids, num_cached_tokens=0)
    t_d2 = d.schedule()
    assert t_d2.aborts == [handle]
    (pl,) = t_d2.placements
    assert pl.block_ids == blocks and pl.num_cached_tokens == pl.num_prefill_tokens == 40
    assert pl.last_token_id == 11 and pl.num_output_tokens == 1
    d.check_integrity()
    for _ in range(4):
        d.apply_report(report(d, [(dreq.handle, dreq.num_tokens - 1 + 1, [3])]))
        d.schedule()
        d.check_integrity()
    assert dreq.finish_reason == FinishReason.LENGTH and dreq.output_token_ids == [11, 3, 3, 3, 3]
    assert d.kv.num_free_blocks == d.kv.pool.num_blocks


def test_decode_instance_admits_no_new_prompts_and_cancel_frees_reservation() -> None:
    d = make_scheduler(role="decode")
    r = make_request(16)
    d.add_request(r)
    assert not d.schedule().placements
    other = make_request(40)
    d.preallocate(other)
    d.abort(other.req_id)
    assert d.kv.num_free_blocks == d.kv.pool.num_blocks
    with pytest.raises(RequestNotFound):
        d.add_prefilled(other.req_id, [1], 0)
    d.check_integrity()


def test_transfer_failure_ends_request_with_error() -> None:
    p = make_scheduler(role="prefill")
    req = make_request(40, max_tokens=5)
    req.kv_target = ("D", 0, [0, 1, 2])
    p.add_request(req)
    p.schedule()
    ev = p.apply_report(
        report(p, [(req.handle, 40, [])]).__class__(
            step=p.last_report_step + 1, applied_seq=p.last_tasks_seq, failed=[req.handle]
        )
    )
    assert req.status == RequestStatus.FINISHED_ERROR and ev.finished == [req]
    assert p.kv.num_free_blocks == p.kv.pool.num_blocks


def test_router_prefers_cached_prefix_then_load() -> None:
    a, b = make_scheduler(instance_id="a"), make_scheduler(instance_id="b")
    prefix = list(range(500, 500 + 256))
    warm = make_request([*prefix, 1], max_tokens=1)
    b.add_request(warm)
    while not warm.is_finished:
        step(b)
    router = Router()
    assert router.pick([a, b], make_request([*prefix, 2])) == 1
    assert router.pick([a, b], make_request(300)) in (0, 1)
    # No overlap: the less loaded instance.
    for r in [make_request(8, max_tokens=50) for _ in range(100)]:
        b.add_request(r)
    assert router.pick([a, b], make_request(300)) == 0


def test_core_imports_no_io_framework_or_clock() -> None:
    banned = {
        "grpc",
        "google",
        "opentelemetry",
        "asyncio",
        "threading",
        "time",
        "datetime",
        "concurrent",
        "socket",
        "prometheus_client",
        "multiprocessing",
        "random",
    }
    root = pathlib.Path(kvsched.core.__file__).parent
    offenders = []
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                top = n.split(".")[0]
                if top in banned or n.startswith(("kvsched.server", "kvsched.v1")):
                    offenders.append(f"{path.name}: {n}")
    assert not offenders, offenders


def test_failed_push_with_the_first_token_is_a_failed_hand_off() -> None:
    p = make_scheduler(role="prefill")
    req = make_request(40, max_tokens=5)
    req.kv_target = ("D", 0, [0, 1, 2])
    p.add_request(req)
    p.schedule()
    rep = report(p, [(req.handle, 40, [7])])
    rep.failed = [req.handle]
    ev = p.apply_report(rep)
    assert ev.hand_off_failed == [req] and not ev.handed_off and not ev.finished
    assert req.output_token_ids == [7] and not req.is_finished  # the token is kept
    assert p.kv.num_free_blocks == p.kv.pool.num_blocks and not p.requests
    p.check_integrity()


def test_decode_instance_recomputes_a_reservation_whose_push_failed() -> None:
    d = make_scheduler(role="decode", instance_id="D")
    req = make_request(40, max_tokens=5)
    handle, _ = d.preallocate(req)
    d.schedule()
    dreq = d.recompute_reserved(req.req_id, [11])
    assert dreq.status == RequestStatus.WAITING and d.kv.num_free_blocks == d.kv.pool.num_blocks
    tasks = d.schedule()
    assert tasks.aborts == [handle]
    (pl,) = tasks.placements
    assert (pl.num_cached_tokens, pl.num_prefill_tokens, pl.last_token_id) == (0, 41, -1)
    assert pl.num_output_tokens == 1  # the first token, prefilled here with the prompt
    prefilled = [t for c in tasks.chunks for t in c.token_ids]
    for _ in range(20):
        if dreq.is_finished:
            break
        run_tasks(d, tasks)
        d.check_integrity()
        tasks = d.schedule()
        prefilled += [t for c in tasks.chunks for t in c.token_ids]
    assert prefilled == req.prompt_token_ids + [11]
    assert dreq.status == RequestStatus.FINISHED_LENGTH and dreq.num_output_tokens == 5
    assert d.kv.num_free_blocks == d.kv.pool.num_blocks
    with pytest.raises(RequestNotFound):
        d.recompute_reserved(req.req_id, [11])


def test_decode_instance_readmits_a_request_it_preempted() -> None:
    d = make_scheduler(
        role="decode", block_size=4, num_gpu_blocks=6, prealloc_blocks=1, prealloc_threshold=0
    )
    a, b = make_request(8, max_tokens=20), make_request(8, max_tokens=20)
    for r in (a, b):
        assert d.preallocate(r) is not None
    da = d.add_prefilled(a.req_id, [1], 0)
    db = d.add_prefilled(b.req_id, [1], 0)
    d.schedule()
    for _ in range(12):  # decode until the pool runs dry and one of them is preempted
        rows = [
            (r.handle, r.num_tokens, [2]) for r in (da, db) if r.status == RequestStatus.RUNNING
        ]
        d.apply_report(report(d, rows))
        t = d.schedule()
        if t.preempts:
            d.apply_report(report(d, [], acked=t.preempts))
            break
    victim = da if da.status == RequestStatus.WAITING else db
    assert victim.status == RequestStatus.WAITING
    d.abort((db if victim is da else da).req_id)
    t = d.schedule()
    assert [pl.req_id for pl in t.placements] == [victim.req_id], "victim never re-admitted"
    d.check_integrity()


def test_handles_continue_across_a_replacement_scheduler() -> None:
    from kvsched.core import Scheduler

    old = make_scheduler()
    old.add_request(make_request(8))
    old.schedule()
    new = Scheduler(old.config, first_handle=old.next_handle)
    r = make_request(8)
    new.add_request(r)
    new.schedule()
    # Handles map to slots (handle & mask == slot), so the new one may skip ahead; it never
    # names an old request.
    assert r.handle >= old.next_handle and r.handle & new.slots.mask == r.slot
    with pytest.raises(ProtocolError, match="never issued"):
        new.apply_report(report(new, [(0, 1, [])]))


def test_router_weighs_queued_work_in_predicted_seconds_not_requests() -> None:
    a = make_scheduler(instance_id="a", num_gpu_blocks=4000, max_model_len=65536)
    b = make_scheduler(instance_id="b", num_gpu_blocks=4000, max_model_len=65536)
    a.add_request(make_request(40_000, max_tokens=4))  # one prompt: ~1.9 s of prefill
    for _ in range(40):
        b.add_request(make_request(16, max_tokens=4))  # many requests: ~14 ms in all
    assert a.predicted_backlog_ms() > 100 * b.predicted_backlog_ms() > 0
    router = Router()
    assert router.count_load(a) < router.count_load(b)  # by counts, a looks idle
    assert router.pick([a, b], make_request(300)) == 1
    # Prefix overlap still comes first while the backlogs are close.
    prefix = list(range(700, 700 + 512))
    c = make_scheduler(instance_id="c")
    warm = make_request([*prefix, 1], max_tokens=1)
    c.add_request(warm)
    while not warm.is_finished:
        step(c)
    d = make_scheduler(instance_id="d")
    d.add_request(make_request(16, max_tokens=4))
    assert router.pick([d, c], make_request([*prefix, 2])) == 1
