"""The prefill role's hand-off through the storage tier (`cache.pd_transfer = "storage"`,
core/scheduler/pd_storage.py), on a bare scheduler: the worker is told to sample the first
token only; at that token the prompt's full blocks are written and the request leaves its slot;
it is handed off only once its writes are acknowledged (or failed); a lost instance gives back
the ones still waiting."""

from __future__ import annotations

from typing import Any

from kvsched.core import Scheduler, StorageIndex
from kvsched.core.protocol import Tasks
from kvsched.core.scheduler import Events
from tests.core.factories import make_request
from tests.core.test_storage_tier import A, keys_of, sched, work


def _work(s: Scheduler, t: Tasks, **kw: Any) -> Events:
    """`work`, returning the events its report's apply_report handed out."""
    got: list[Events] = []
    apply = s.apply_report
    s.apply_report = lambda report: got.append(apply(report)) or got[-1]  # type: ignore[method-assign]
    try:
        work(s, t, **kw)
    finally:
        del s.apply_report
    return got[0]


def _prefilled(index: StorageIndex) -> tuple:  # type: ignore[type-arg]
    s = sched(index, role="prefill", pd_transfer="storage")
    a = make_request(A + [1], max_tokens=8)  # 49 tokens: 3 full blocks
    s.add_request(a)
    t = s.schedule()
    assert [p.sampling.max_tokens for p in t.placements] == [1] and a.sampling.max_tokens == 8
    assert not t.kv_sends
    work(s, t)  # the prompt's step: its first token
    assert a.output_token_ids == [7] and a.req_id not in s.requests
    assert s.kv.num_free_blocks == 8, "its slot and blocks are freed at once"
    return s, a


def test_handed_off_once_its_prompt_blocks_are_stored() -> None:
    index = StorageIndex()
    s, a = _prefilled(index)
    t = s.schedule()
    keys = keys_of(s, a, 3)
    assert t.storage_write_keys == keys and t.aborts == [a.handle]
    assert all(index.is_writing(k) for k in keys)
    assert s.stored_prompt_blocks(a) == 0
    assert s.reports.stored_hand_offs is not None
    assert s.reports.stored_hand_offs.pending == [a], "not handed off before the ack"
    ev = _work(s, t)  # the worker applied it: the writes are acknowledged
    assert ev.handed_off_stored == [a]
    assert s.stored_prompt_blocks(a) == 3 and not s.take_stored_hand_offs()


def test_failed_writes_still_hand_off_with_nothing_stored() -> None:
    index = StorageIndex()
    s, a = _prefilled(index)
    t = s.schedule()
    ev = _work(s, t, failed_writes=list(t.storage_write_keys))
    assert ev.handed_off_stored == [a]  # the decode side recomputes
    assert s.stored_prompt_blocks(a) == 0 and len(index) == 0


def test_a_lost_instance_gives_back_the_hand_offs_still_writing() -> None:
    index = StorageIndex()
    s, a = _prefilled(index)
    s.schedule()  # the writes are sent, never acknowledged
    assert s.take_stored_hand_offs() == [a]
    assert not s.take_stored_hand_offs()


def test_a_peers_stored_prefix_is_trusted_into_the_index() -> None:
    index = StorageIndex()
    d = sched(index, role="decode")
    a = make_request(A + [1], max_tokens=8)
    d.trust_stored_prefix(a, 2)
    assert d.stored_prompt_blocks(a) == 2
    assert [k in index for k in keys_of(d, a, 3)] == [True, True, False]
