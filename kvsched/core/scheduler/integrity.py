"""The scheduler's invariants, asserted (`check_integrity`): O(everything), for tests and
debugging, never on a hot path. Every block owned as often as tables name it, every placed
request on its own slot under a live handle, every live request in exactly one state, and the
counters (`num_decoding`, the prefill debt, the running and waiting LoRA adapters) equal to
what they count.

Reads the state the placement table, the backlog and the caches own and changes nothing;
imported by the scheduler facade only.
"""

from __future__ import annotations

from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.slots import RING


def check_integrity(
    sched: PlacementTable,
    backlog: Backlog,
    kv: KVCacheManager,
    enc: EncoderCache | None,
    held: list[Request] | None = None,
) -> None:
    """Assert every invariant of the scheduler's state (see the module docstring). `held`:
    the samples held by their groups (WAITING, not queued, holding nothing)."""
    held = held or []
    for r in held:
        assert r.status == RequestStatus.WAITING, f"{r.req_id}: held but {r.status!r}"
        assert not r.block_ids and r.slot < 0, f"{r.req_id}: held but holds resources"
    owners: dict[int, int] = {}
    placed = list(sched.running.values()) + [
        r for r in sched.reserved.values() if r.req_id not in sched.running
    ]
    for req in placed:
        assert req.status == RequestStatus.RUNNING, f"{req.req_id}: placed but {req.status!r}"
        assert len(set(req.block_ids)) == len(req.block_ids), f"{req.req_id}: block twice"
        for b in req.block_ids:
            owners[b] = owners.get(b, 0) + 1
        assert sched.live.get(req.handle) is req, f"{req.req_id}: handle not live"
        assert req.slot >= 0
    kv.pool.check_integrity(owners)
    if kv.host is not None:  # the host pool: every pin is a copy queued or in flight
        kv.host.check_integrity()
    if kv.storage is not None:  # storage writes hold their claims; fetches name live handles
        kv.storage.check_integrity(set(sched.live))
    if kv.prefetch is not None:  # prefetches belong to waiting requests; pins counted
        kv.prefetch.check_integrity({r.req_id for r in backlog.waiting})
    if enc is not None:  # within capacity; needed items only by requests that hold them
        enc.check_integrity(sched.enc_needed)
    for req in placed:  # a cached block under a request holds that request's tokens
        for b, h in zip(req.block_ids, req.block_hashes, strict=False):
            got = kv.pool.block_hash[b]
            assert got is None or got == h, f"{req.req_id}: block {b} holds other tokens"
    # A block in two tables must hold the same tokens in both: the same chained hash at
    # the same index (it may have lost its cache entry to reset_prefix_cache since).
    content: dict[int, bytes | None] = {}
    for req in placed:
        for i, b in enumerate(req.block_ids):
            if owners[b] > 1:
                hb = req.block_hashes[i] if i < len(req.block_hashes) else None
                assert hb is not None, f"block {b} shared but {req.req_id} has no hash for it"
                assert content.setdefault(b, hb) == hb, f"block {b} shared with other tokens"
    slots = [r.slot for r in placed]
    assert len(set(slots)) == len(slots), "two requests on one slot"
    table = sched.slots
    for req in placed:
        table.check_bound(req, RING)
    bound = {i for i, r in enumerate(table.reqs) if r is not None}
    assert bound == set(slots), "slot table rows != placed requests"
    assert all(int(table.handle[i]) == -1 for i in range(table.size) if i not in bound)
    assert len(slots) + len(sched.free_slots) == sched.num_slots
    assert set(slots).isdisjoint(sched.free_slots), "a slot both used and free"
    waiting = list(backlog.waiting)
    assert len(waiting) == len(backlog.waiting), "queue count drifted"
    awaiting = [r for r in sched.live.values() if r.status == RequestStatus.PREEMPTED]
    for r in awaiting:
        assert not r.block_ids and r.slot < 0, f"{r.req_id}: preempted but holds resources"
    groups = [
        set(r.req_id for r in waiting),
        set(sched.running),
        set(r.req_id for r in awaiting),
        set(r.req_id for r in held),
    ]
    assert sum(map(len, groups)) == len(set().union(*groups)), "a request in two states"
    live_ids = set().union(*groups) | set(sched.reserved)
    assert live_ids == set(sched.requests), "live set != waiting + running + awaiting-ack + held"
    assert sched.num_decoding == sum(1 for r in sched.running.values() if r.is_prefill_done)
    debt = sum(sched.full_blocks(r) - len(r.block_ids) for r in sched.prefilling.values())
    assert sched.prefill_debt == debt, f"prefill debt {sched.prefill_debt} != {debt}"
    assert set(sched.prefilling) == {
        r.req_id for r in sched.running.values() if not r.is_prefill_done
    }
    running_loras: dict[str, int] = {}
    for r in sched.running.values():
        if r.lora_name:
            running_loras[r.lora_name] = running_loras.get(r.lora_name, 0) + 1
    assert sched.loras == running_loras, f"running adapters {sched.loras} != {running_loras}"
    waiting_loras: dict[str, int] = {}
    for r in waiting:
        if r.lora_name:
            waiting_loras[r.lora_name] = waiting_loras.get(r.lora_name, 0) + 1
    queued = backlog.waiting.loras
    assert queued == waiting_loras, f"waiting adapters {queued} != {waiting_loras}"
