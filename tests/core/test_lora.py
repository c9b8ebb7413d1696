"""LoRA adapters in the core: at most max_loras distinct adapters placed at once (vLLM's rule: a
request with a new adapter waits while max_loras run, the requests behind it go), the adapters
running and waiting counted (vLLM's lora_requests_info), and the router's adapter affinity
(llm-d's order: loaded > a free adapter slot > neither)."""

from __future__ import annotations

import random

from kvsched.core import Router
from tests.core.factories import make_request, make_scheduler, run_tasks, step


def _placed_loras(s: object) -> set[str]:
    return {r.lora_name for r in s.running.values() if r.lora_name}  # type: ignore[attr-defined]


def test_a_third_adapter_waits_while_two_run_and_the_requests_behind_it_go() -> None:
    s = make_scheduler(max_loras=2)
    a, b = make_request(40, lora_name="a"), make_request(40, lora_name="b")
    c = make_request(40, lora_name="c")
    a2, base = make_request(40, lora_name="a"), make_request(40)
    for r in (a, b, c, a2, base):
        s.add_request(r)
    tasks, _ = step(s)
    placed = [p.req_id for p in tasks.placements]
    assert placed == [a.req_id, b.req_id, a2.req_id, base.req_id]
    assert [p.lora_name for p in tasks.placements] == ["a", "b", "a", ""]
    assert s.lora_state().running == {"a": 2, "b": 1}
    assert s.lora_state().waiting == {"c": 1}
    assert s.waiting.peek() is c, "the skipped request keeps its place at the queue's front"


def test_the_waiting_adapter_runs_once_an_adapter_is_no_longer_placed() -> None:
    s = make_scheduler(max_loras=2)
    a, b = make_request(20, 2, lora_name="a"), make_request(20, 30, lora_name="b")
    c = make_request(20, 2, lora_name="c")
    for r in (a, b, c):
        s.add_request(r)
    seen_c_with: set[str] = set()
    for _ in range(40):
        step(s)
        assert len(_placed_loras(s)) <= 2
        if c.req_id in s.running:
            seen_c_with = _placed_loras(s)
            break
    assert seen_c_with == {"b", "c"}, "c ran only after a's request finished, beside b"


def test_no_limit_places_every_adapter_and_base_requests_never_wait() -> None:
    s = make_scheduler()  # max_loras 0: no limit announced
    reqs = [make_request(20, lora_name=f"x{i}") for i in range(5)] + [make_request(20)]
    for r in reqs:
        s.add_request(r)
    tasks, _ = step(s)
    assert len(tasks.placements) == 6
    s1 = make_scheduler(max_loras=1)
    for r in [make_request(20, lora_name="p"), make_request(20, lora_name="q"), make_request(20)]:
        s1.add_request(r)
    tasks, _ = step(s1)
    assert [p.lora_name for p in tasks.placements] == ["p", ""]


def test_interleaved_adapters_never_exceed_max_loras_on_any_step_and_all_finish() -> None:
    rng = random.Random(3)
    s = make_scheduler(max_loras=2, num_gpu_blocks=60, max_num_seqs=6)
    names = ["a", "b", "c", ""]
    reqs = [
        make_request(rng.randrange(5, 60), rng.randrange(1, 12), lora_name=rng.choice(names))
        for _ in range(40)
    ]
    pending = list(reqs)
    finished: set[str] = set()
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            s.add_request(pending.pop(0))
        tasks = s.schedule()
        assert len(_placed_loras(s)) <= 2, "more than max_loras adapters placed"
        events = run_tasks(s, tasks)
        s.check_integrity()
        finished.update(r.req_id for r in events.finished)
        if not pending and len(finished) == len(reqs):
            break
    assert finished == {r.req_id for r in reqs}
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks, "every block returned"
    assert s.lora_state().running == {} and s.lora_state().waiting == {}


def test_an_aborted_waiting_request_leaves_the_waiting_adapters() -> None:
    s = make_scheduler(max_loras=1)
    a, b = make_request(20, lora_name="a"), make_request(20, lora_name="b")
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.lora_state().waiting == {"b": 1}
    s.abort(b.req_id)
    s.check_integrity()
    assert s.lora_state().waiting == {}


def test_router_prefers_the_instance_with_the_adapter_loaded_then_a_free_slot() -> None:
    router = Router(overload="off")
    loaded = make_scheduler(max_loras=2, instance_id="loaded")
    free = make_scheduler(max_loras=2, instance_id="free")
    full = make_scheduler(max_loras=2, instance_id="full")
    for _ in range(3):  # the loaded instance is the busiest
        loaded.add_request(make_request(200, lora_name="a"))
    for name in ("x", "y"):
        full.add_request(make_request(20, lora_name=name))
    for sched in (loaded, free, full):
        step(sched)
    cands = [full, free, loaded]
    assert router.pick(cands, make_request(20, lora_name="a")) == 2, "loaded first"
    assert router.pick(cands, make_request(20, lora_name="b")) == 1, "then a free slot"
    assert [c.lora_affinity(make_request(20, lora_name="b")) for c in cands] == [0, 1, 1]
    # A request without an adapter is placed by prefix and load alone: not on the busiest.
    assert router.pick(cands, make_request(20)) != 2


def test_a_decode_instance_holds_hand_offs_of_at_most_max_loras_adapters() -> None:
    """P/D: a decode instance starts a held request decoding the moment its KV arrives, so
    max_loras binds when it holds room: a hand-off of a third adapter finds no room (the
    daemon's reservation is refused: retried) while two are held or running, one of an
    adapter already there or of none does; once an adapter's requests are gone it has room."""
    d = make_scheduler(role="decode", max_loras=2)
    a, b = make_request(40, 3, lora_name="a"), make_request(40, 3, lora_name="b")
    a2, base = make_request(40, 3, lora_name="a"), make_request(40, 3)
    c = make_request(40, 3, lora_name="c")
    for r in (a, b):
        assert d.preallocate(r) is not None
    assert d.preallocate(c) is None, "a third adapter held while two are"
    # Held adapters count for routing hand-offs too: a held one is in use, the slots are full.
    assert (d.lora_affinity(make_request(8, lora_name="a")), d.lora_affinity(c)) == (2, 0)
    for r in (a2, base):
        assert d.preallocate(r) is not None
    for r in (a, b, a2, base):
        d.add_prefilled(r.req_id, [7], num_cached_tokens=0)
    assert d.lora_state().running == {"a": 2, "b": 1}
    assert d.preallocate(c) is None, "a third adapter while two run"
    for _ in range(10):  # decode them to their end: never more than two adapters a step
        tasks, _ = step(d)
        placed = {p.lora_name for p in tasks.placements if p.lora_name}
        assert len(placed | _placed_loras(d)) <= 2
        if not d.running:
            break
    assert not d.running and d.kv.num_free_blocks == d.kv.pool.num_blocks
    assert d.preallocate(c) is not None
    d.check_integrity()


def test_a_hand_off_keys_its_prefix_blocks_by_adapter() -> None:
    """The decode side caches a handed-off request's blocks under its adapter (as vLLM's
    prefix cache keys blocks by LoRA): the same prompt under another adapter, or none, hits
    nothing there; under the same adapter it hits the prompt's full blocks."""
    d = make_scheduler(role="decode", max_loras=2)
    prompt = list(range(500, 564))  # 4 full blocks of 16
    r = make_request(prompt, 2, lora_name="x")
    assert d.preallocate(r) is not None
    d.add_prefilled(r.req_id, [7], num_cached_tokens=0)
    assert d.prefix_hit_tokens(make_request(prompt, 2, lora_name="x")) >= 48
    assert d.prefix_hit_tokens(make_request(prompt, 2, lora_name="y")) == 0
    assert d.prefix_hit_tokens(make_request(prompt, 2)) == 0
