"""The storage KV tier (kvsched/core/storage.py): keys, write policies (on eviction from the
last tier above, write-through), fetches of storage hits ordered after swap-ins, pins held by
writes until acknowledged, failed writes and fetches, the cost model's veto, one StorageIndex
shared by two schedulers, storage KV events. check_integrity runs after every step.

A "worker" here is `work()`: it runs a Tasks message's chunks and decodes as
tests/core/test_host_tier.work does, and reports which storage tasks failed."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core import ConfigError, Request, Scheduler, StepReport, StorageIndex, Tasks
from kvsched.core.kv_events import STORAGE, BlockRemoved, BlockStored
from tests.core.factories import make_config, make_request

BS = 16
A = list(range(1000, 1048))  # 3 full blocks
FILL = list(range(5000, 5000 + 8 * BS - 1))  # needs all 8 GPU blocks: evicts everything cached


def sched(index: StorageIndex | None, ns: str = "m", **kw: Any) -> Scheduler:
    kw.setdefault("block_size", BS)
    kw.setdefault("num_gpu_blocks", 8)
    kw.setdefault("prealloc_threshold", 0)
    kw.setdefault("prealloc_blocks", 1)
    kw.setdefault("max_model_len", 8192)
    s = Scheduler(make_config(**kw), instance_id="i0", storage=index, storage_namespace=ns)
    return s


def work(
    s: Scheduler,
    tasks: Tasks,
    applied: int | None = None,
    failed_writes: list[str] | None = None,
    failed_fetches: list[int] | None = None,
) -> None:
    """Run `tasks` as one worker step and report it (applied: the applied_seq to report;
    a handle whose fetch failed runs nothing)."""
    skip = set(failed_fetches or [])
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
            failed_storage_writes=failed_writes or [],
            failed_storage_fetches=failed_fetches or [],
        )
    )
    s.check_integrity()


def busy(s: Scheduler) -> bool:
    st, host = s.kv.storage, s.kv.host
    copies = host is not None and (host.has_queued() or host.num_in_flight > 0)
    return copies or (st is not None and (st.has_queued() or st.num_in_flight > 0))


def run_to_end(s: Scheduler, *reqs: Request, limit: int = 60) -> list[Tasks]:
    """Queue `reqs`, then `drain`."""
    for r in reqs:
        s.add_request(r)
    return drain(s, *reqs, limit=limit)


def drain(s: Scheduler, *reqs: Request, limit: int = 60) -> list[Tasks]:
    """schedule + work until `reqs` finished and no storage task or copy is under way."""
    sent = []
    for _ in range(limit):
        if all(r.is_finished for r in reqs) and not busy(s):
            return sent
        t = s.schedule()
        s.check_integrity()
        sent.append(t)
        work(s, t)
    raise AssertionError("requests did not finish")


def keys_of(s: Scheduler, req: Request, n: int) -> list[str]:
    assert s.kv.storage is not None
    return s.kv.storage.keys(req.block_hashes[:n])


def test_without_a_storage_index_nothing_changes() -> None:
    s = sched(None)
    assert s.kv.storage is None
    for t in run_to_end(s, make_request(A + [1], max_tokens=1)):
        assert not (t.storage_write_keys or t.storage_fetch_keys)
    assert not s.snapshot().storage_enabled


def test_keys_are_model_block_size_and_chained_hash_with_salt_and_lora() -> None:
    index = StorageIndex()
    s = sched(index, ns="llama")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    key = keys_of(s, a, 1)[0]
    assert key == f"llama/{BS}/{a.block_hashes[0].hex()}"
    salted = make_request(A + [1], max_tokens=1, cache_salt="tenant-b")
    lora = make_request(A + [1], max_tokens=1, lora_name="ad")
    s.kv.ensure_hashes(salted, 3)
    s.kv.ensure_hashes(lora, 3)
    assert len({key, *keys_of(s, salted, 1), *keys_of(s, lora, 1)}) == 3
    other_model = sched(index, ns="qwen")
    assert other_model.kv.storage is not None
    assert other_model.kv.storage.key(a.block_hashes[0]) != key


def test_no_host_tier_writes_gpu_blocks_on_eviction_stored_only_on_ack() -> None:
    index = StorageIndex()
    s = sched(index)
    s.enable_kv_events()
    a = make_request(A + [1], max_tokens=1)
    sent = run_to_end(s, a)
    assert not any(t.storage_write_keys for t in sent), "write_back writes nothing before eviction"
    a_blocks = [s.kv.pool.lookup(h) for h in a.block_hashes[:3]]
    s.take_kv_events()
    x = make_request(FILL, max_tokens=1)
    s.add_request(x)
    t = s.schedule()
    s.check_integrity()
    # The evicted GPU blocks are written in the message whose chunk reuses them (the worker
    # runs storage_writes before chunks).
    assert sorted(t.storage_write_keys) == sorted(keys_of(s, a, 3))
    assert sorted(t.storage_write_blocks) == sorted(a_blocks)
    assert len(index) == 0, "a key is stored only once its write is acknowledged"
    assert all(index.is_writing(k) for k in t.storage_write_keys)
    work(s, t)
    assert set(index.run_from(keys_of(s, a, 3))) == set(keys_of(s, a, 3))
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored) and e.medium == STORAGE]
    assert [h for e in stored for h in e.block_hashes] == [
        bytes.fromhex(k.split("/")[-1]) for k in t.storage_write_keys
    ]


def test_storage_hits_are_fetched_into_fresh_blocks_and_chunks_start_after_them() -> None:
    index = StorageIndex()
    s = sched(index)
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(FILL, max_tokens=1))  # evicts a's blocks: written to storage
    assert s.kv.pool.lookup(a.block_hashes[0]) is None
    b = make_request(A + [2, 3], max_tokens=2)
    s.add_request(b)
    t = s.schedule()
    s.check_integrity()
    assert t.storage_fetch_keys == keys_of(s, b, 3)
    assert t.storage_fetch_handles == [b.handle] * 3
    assert t.storage_fetch_gpu == b.block_ids[:3]
    assert t.placements[0].num_cached_tokens == 3 * BS
    assert t.chunks[0].start == 3 * BS
    work(s, t)
    drain(s, b)
    assert b.num_output_tokens == 2
    snap = s.snapshot()
    assert snap.prefix_cache_storage_hit_tokens == 3 * BS
    assert snap.num_storage_fetches == 3
    # Once reported, the fetched blocks are GPU prefix hits again.
    assert all(s.kv.pool.lookup(h) is not None for h in b.block_hashes[:3])


def test_two_schedulers_share_one_index_a_write_of_one_is_a_hit_of_the_other() -> None:
    index = StorageIndex()
    s1, s2 = sched(index), sched(index)
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s1, a)
    x = make_request(FILL, max_tokens=1)
    s1.add_request(x)
    t = s1.schedule()
    assert t.storage_write_keys
    c = make_request(A + [3], max_tokens=1)
    assert s2.kv.lookup(c).storage == [], "a write not yet acknowledged is no hit for others"
    work(s1, t)
    drain(s1, x)
    s2.add_request(c)
    t2 = s2.schedule()
    s2.check_integrity()
    assert t2.storage_fetch_keys == keys_of(s1, a, 3)
    work(s2, t2)
    drain(s2, c)
    # Neither writes content the other has stored: s2 evicting its fetched copies writes none.
    y = make_request(FILL[::-1], max_tokens=1)
    sent = run_to_end(s2, y)
    assert not set(keys_of(s1, a, 3)) & {k for t in sent for k in t.storage_write_keys}


def test_a_failed_fetch_preempts_recomputes_and_unindexes_the_keys() -> None:
    index = StorageIndex()
    s = sched(index)
    s.enable_kv_events()
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(FILL, max_tokens=1))
    keys = keys_of(s, a, 3)
    assert index.run_from(keys) == keys
    s.take_kv_events()
    b = make_request(A + [2], max_tokens=3)
    s.add_request(b)
    t = s.schedule()
    assert t.storage_fetch_handles == [b.handle] * 3
    work(s, t, failed_fetches=[b.handle])  # the store lost them
    assert b.num_preemptions == 1
    assert not any(k in index for k in keys), "a failed fetch's keys leave the index"
    removed = [e for e in s.take_kv_events() if isinstance(e, BlockRemoved)]
    assert any(
        e.medium == STORAGE and set(e.block_hashes) == set(b.block_hashes[:3]) for e in removed
    )
    sent = drain(s, b)
    assert b.num_output_tokens == 3, "the preempted request recomputed and finished"
    assert not any(t.storage_fetch_keys for t in sent), "no key left to fetch: recomputed"
    assert s.snapshot().num_storage_fetch_failures == 3


def test_a_failed_write_is_never_stored_and_can_be_written_again() -> None:
    index = StorageIndex()
    s = sched(index)
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    x = make_request(FILL, max_tokens=1)
    s.add_request(x)
    t = s.schedule()
    bad = t.storage_write_keys[0]
    work(s, t, failed_writes=[bad])
    assert bad not in index and not index.is_writing(bad)
    assert all(k in index for k in t.storage_write_keys[1:])
    assert s.snapshot().num_storage_write_failures == 1
    drain(s, x)
    # The content comes back (recomputed), is evicted again: written again.
    b = make_request(A + [1], max_tokens=1)
    run_to_end(s, b)
    sent = run_to_end(s, make_request(FILL[1:] + [9], max_tokens=1))
    assert bad in {k for t in sent for k in t.storage_write_keys}
    assert bad in index


def test_write_through_without_a_host_tier_writes_once_registered() -> None:
    index = StorageIndex()
    s = sched(index, storage_write_policy="write_through")
    a = make_request(A + [1], max_tokens=1)
    sent = run_to_end(s, a)
    written = [k for t in sent for k in t.storage_write_keys]
    assert sorted(written) == sorted(keys_of(s, a, 3))
    assert all(k in index for k in written)


def test_host_tier_write_back_pins_the_victim_until_its_write_is_acknowledged() -> None:
    index = StorageIndex()
    # Host tier of 3 blocks, written back from GPU on eviction; storage written back from host.
    s = sched(index, num_host_blocks=3, host_write_policy="write_back")
    host = s.kv.host
    assert host is not None and s.kv.storage is not None
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(FILL, max_tokens=1))  # a's 3 blocks -> host
    assert set(host.pool.cached) == set(a.block_hashes[:3])
    a_host = sorted(host.pool.cached.values())
    # The next eviction (FILL's blocks to host) would evict a's host blocks: they are pinned
    # and written to storage instead; with every host block pinned the swap-outs are skipped.
    y = make_request(list(range(9000, 9000 + 8 * BS - 1)), max_tokens=1)
    s.add_request(y)
    t = s.schedule()
    s.check_integrity()
    assert sorted(t.storage_write_blocks) == a_host, "written from the host blocks"
    assert sorted(t.storage_write_keys) == sorted(keys_of(s, a, 3))
    assert not t.swap_out_gpu, "every host block is pinned by a write in flight"
    assert all(host.pool.ref_cnt[b] == 1 for b in a_host)
    # The ack comes late: the pins hold across steps.
    work(s, t, applied=t.seq - 1)
    assert all(host.pool.ref_cnt[b] == 1 for b in a_host)
    t2 = s.schedule()
    s.check_integrity()
    work(s, t2)  # acknowledges both messages
    assert all(k in index for k in keys_of(s, a, 3))
    # Written, the victims are evicted (as without the tier): the host LRU keeps its order.
    assert not set(a.block_hashes[:3]) & set(host.pool.cached)
    assert all(host.pool.ref_cnt[b] == 0 for b in a_host)
    drain(s, y)
    # A host miss, a storage hit: b fetches a's blocks.
    b = make_request(A + [2], max_tokens=1)
    sent = run_to_end(s, b)
    assert sent[0].storage_fetch_keys == keys_of(s, a, 3)


def test_host_tier_write_through_writes_once_the_swap_out_is_acknowledged() -> None:
    index = StorageIndex()
    s = sched(
        index,
        num_host_blocks=8,
        host_write_policy="write_through",
        storage_write_policy="write_through",
    )
    a = make_request(A + [1], max_tokens=1)
    sent = run_to_end(s, a)
    host = s.kv.host
    assert host is not None
    written = {
        k: b
        for t in sent
        for k, b in zip(t.storage_write_keys, t.storage_write_blocks, strict=True)
    }
    assert set(written) == set(keys_of(s, a, 3))
    assert {written[k] for k in keys_of(s, a, 3)} == {
        host.pool.cached[h] for h in a.block_hashes[:3]
    }, "written from the host blocks"


def test_host_hits_then_storage_hits_swap_ins_before_fetches() -> None:
    index = StorageIndex()
    s1 = sched(index)  # no host tier: writes a's blocks to the store when evicted
    s2 = sched(index, num_host_blocks=8, host_write_policy="write_back")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s1, a)
    run_to_end(s1, make_request(FILL, max_tokens=1))
    # s2 gets a's first block (fetched), then evicts it to its host tier.
    run_to_end(s2, make_request(A[:BS] + [5], max_tokens=1))
    run_to_end(s2, make_request(FILL, max_tokens=1))
    assert s2.kv.host is not None and a.block_hashes[0] in s2.kv.host.pool.cached
    b = make_request(A + [2], max_tokens=1)
    s2.add_request(b)
    t = s2.schedule()
    s2.check_integrity()
    assert len(t.swap_in_gpu) == 1 and len(t.storage_fetch_gpu) == 2
    assert b.block_ids[:1] == t.swap_in_gpu
    assert b.block_ids[1:3] == t.storage_fetch_gpu
    assert t.storage_fetch_keys == keys_of(s2, b, 3)[1:]
    assert t.chunks[0].start == 3 * BS
    work(s2, t)
    drain(s2, b)


def test_fetches_declined_when_the_cost_model_prices_them_above_recomputing() -> None:
    index = StorageIndex()
    cfg = make_config(block_size=BS, num_gpu_blocks=8, prealloc_threshold=0, prealloc_blocks=1)
    cfg.step_cost.per_fetched_block_ms = 1e3
    s = Scheduler(cfg, storage=index, storage_namespace="m")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(FILL, max_tokens=1))
    b = make_request(A + [2], max_tokens=1)
    s.add_request(b)
    t = s.schedule()
    s.check_integrity()
    assert not t.storage_fetch_keys and t.chunks[0].start == 0
    assert s.snapshot().num_storage_fetches_declined == 3
    work(s, t)
    drain(s, b)


def test_a_reset_drops_unsent_writes_but_keeps_the_shared_index() -> None:
    index = StorageIndex()
    s = sched(index, storage_write_policy="write_through")
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    assert all(k in index for k in keys_of(s, a, 3))
    s.reset_prefix_cache()
    s.check_integrity()
    assert all(k in index for k in keys_of(s, a, 3)), "the store's keys name content"


def test_storage_write_policy_is_checked() -> None:
    with pytest.raises(ConfigError, match="storage_write_policy"):
        make_config(storage_write_policy="write_through_selective").validate()
    with pytest.raises(ConfigError, match="storage_write_policy"):
        make_config(storage_write_policy="sometimes").validate()


def test_the_index_is_bounded_and_forgets_the_oldest() -> None:
    index = StorageIndex(max_keys=2)
    index.add(["a", "b"])
    index.add(["c"])
    assert "a" not in index and index.run_from(["b", "c"]) == ["b", "c"]
    assert not index.begin_write("b") and index.begin_write("d")
    assert not index.begin_write("d"), "a key being written is claimed once"
    index.end_write("d", False)
    assert "d" not in index and index.begin_write("d")


def test_host_writes_beyond_what_a_step_hides_wait_pinned_for_later_messages() -> None:
    index = StorageIndex()
    cfg = make_config(
        block_size=BS,
        num_gpu_blocks=8,
        prealloc_threshold=0,
        prealloc_blocks=1,
        num_host_blocks=3,
        host_write_policy="write_back",
    )
    # Before any step was measured a step is the itl target, 100 ms: it hides two 40-ms writes.
    cfg.step_cost.per_fetched_block_ms = 40.0
    s = Scheduler(cfg, storage=index, storage_namespace="m")
    assert s.plan.storage_write_budget() == 2
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s, a)
    run_to_end(s, make_request(FILL, max_tokens=1))  # a's 3 blocks -> host
    host = s.kv.host
    assert host is not None and set(host.pool.cached) == set(a.block_hashes[:3])
    a_host = sorted(host.pool.cached.values())
    y = make_request(list(range(9000, 9000 + 8 * BS - 1)), max_tokens=1)
    s.add_request(y)
    t = s.schedule()
    s.check_integrity()
    budget = s.plan.storage_write_budget()
    assert 1 <= len(t.storage_write_keys) == min(budget, 3) < 3, "no more than a step hides"
    assert all(host.pool.ref_cnt[b] == 1 for b in a_host), "all 3 victims pinned"
    written = list(t.storage_write_keys)
    for _ in range(10):
        work(s, t)
        if len(written) == 3:
            break
        t = s.schedule()
        s.check_integrity()
        written += t.storage_write_keys
    assert sorted(written) == sorted(keys_of(s, a, 3)), "the others went in later messages"
    drain(s, y)
    assert all(k in index for k in keys_of(s, a, 3))


def test_a_dropped_scheduler_releases_its_write_claims_for_the_others() -> None:
    index = StorageIndex()
    s1, s2 = sched(index), sched(index)
    a = make_request(A + [1], max_tokens=1)
    run_to_end(s1, a)
    s1.add_request(make_request(FILL, max_tokens=1))
    t = s1.schedule()  # writes of a's blocks sent, never acknowledged: the instance is lost
    assert t.storage_write_keys and all(index.is_writing(k) for k in t.storage_write_keys)
    s1.close()
    assert not any(index.is_writing(k) or k in index for k in t.storage_write_keys)
    b = make_request(A + [2], max_tokens=1)
    run_to_end(s2, b)
    sent = run_to_end(s2, make_request(FILL, max_tokens=1))
    written = {k for t2 in sent for k in t2.storage_write_keys}
    assert set(t.storage_write_keys) <= written, "s2 writes what s1 never finished writing"
