"""The scheduler package's own surface: typed token deltas, snapshot(), the module layout."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from kvsched.core.scheduler import DecodeColumn, RowTokens, SchedulerSnapshot
from tests.core.factories import make_request, make_scheduler, report, step

CORE = Path(__file__).parents[2] / "kvsched" / "core"


def test_token_deltas_are_typed_by_shape() -> None:
    """Plain one-token rows come as one DecodeColumn, a row with several tokens as RowTokens;
    both unpack as (requests, slots, tokens)."""
    s = make_scheduler()
    reqs = [make_request(8, max_tokens=50) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    tasks, ev = step(s, token=5)  # the prompts run and sample their first tokens
    (col,) = ev.tokens
    assert isinstance(col, DecodeColumn)
    assert [col.reqs[i] for i in col.slots.tolist()] == reqs
    assert col.tokens.tolist() == [5, 5, 5] and col.tokens.dtype == np.int64
    assert ev.token_reqs == reqs
    reqs_, slots, toks = col
    assert reqs_ is col.reqs and slots is col.slots and toks is col.tokens
    h = [p.handle for p in tasks.placements]
    ev = s.apply_report(report(s, [(h[0], 9, [6]), (h[1], 10, [7, 8]), (h[2], 9, [6])]))
    assert [type(d) for d in ev.tokens] == [DecodeColumn, RowTokens]
    row = ev.tokens[1]
    assert row == (reqs[1], None, [7, 8]) and row.req is reqs[1] and row.tokens == [7, 8]
    assert ev.token_reqs == [reqs[0], reqs[2], reqs[1]]
    assert [r.output_token_ids for r in reqs] == [[5, 6], [5, 7, 8], [5, 6]]
    s.check_integrity()


def test_snapshot_reads_the_scheduler_at_once() -> None:
    s = make_scheduler(max_num_seqs=4, num_gpu_blocks=100)
    for _ in range(6):
        s.add_request(make_request(20, max_tokens=8))
    step(s)
    snap = s.snapshot()
    assert isinstance(snap, SchedulerSnapshot)
    assert (snap.num_running, snap.num_waiting) == (4, 2) == (s.num_running, s.num_waiting)
    assert (snap.num_slots, snap.num_slots_used) == (4, 4)
    assert snap.num_gpu_blocks == 100 and snap.num_free_blocks == s.kv.num_free_blocks
    assert snap.kv_cache_usage == s.kv.usage > 0
    assert snap.num_steps == s.stats.num_steps == 1
    assert snap.num_prompt_tokens == s.stats.num_prompt_tokens == 80
    assert snap.num_generation_tokens == s.stats.num_generation_tokens == 4
    assert snap.prefix_cache_query_tokens == s.kv.num_queries
    assert snap.prefix_cache_hit_tokens == s.kv.num_hits
    assert (snap.last_report_step, snap.last_tasks_seq) == (s.last_report_step, 1)
    assert snap.decode_headroom == s.decode_headroom and not snap.paused
    s.pause()
    assert s.snapshot().paused and snap.num_running == 4  # a snapshot does not change
    assert s.snapshot().num_preemptions == 4


def test_a_late_row_is_dropped_not_delivered() -> None:
    """A row about a handle that left its slot yields no delta (the one-by-one path)."""
    s = make_scheduler()
    req = make_request(8, max_tokens=50)
    s.add_request(req)
    tasks, _ = step(s)
    h = tasks.placements[0].handle
    s.abort(req.req_id)
    ev = s.apply_report(report(s, [(h, 9, [1])]))
    assert ev.tokens == []


def test_request_module_imports_nothing_of_slots() -> None:
    """request.py reads pending tokens through its TokenSource protocol, which slots.py
    implements: no import back (not even for type checking)."""
    tree = ast.parse((CORE / "request.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "kvsched.core.slots" not in imported


def test_scheduler_parts_import_nothing_from_the_package_facade() -> None:
    """The parts import each other by module; only the package's __init__ gathers them."""
    for path in (CORE / "scheduler").glob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                assert n.module != "kvsched.core.scheduler", path.name
                assert n.module != "kvsched.core", path.name
