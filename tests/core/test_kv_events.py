"""KV events: the prefix cache's changes, replayed by a consumer, give exactly the cache."""

from __future__ import annotations

from kvsched.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tests.core.factories import make_request, make_scheduler, step

COMMON = list(range(1000, 1048))  # 3 blocks of 16


def replay(events: list[KvEvent], into: set[bytes]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            into.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            into.difference_update(ev.block_hashes)
        else:
            into.clear()


def test_nothing_is_recorded_unless_enabled() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=20)
    s.add_request(make_request(COMMON + [1], max_tokens=2))
    for _ in range(4):
        step(s)
    assert s.take_kv_events() == [] and s.kv.pool.events is None


def test_replayed_events_equal_the_cache_through_stores_evictions_and_reset() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=12, prealloc_threshold=0, prealloc_blocks=1)
    s.enable_kv_events()
    view: set[bytes] = set()
    first = s.take_kv_events()
    assert isinstance(first[0], AllBlocksCleared)
    seen_removed = False
    for k in range(12):  # different prompts of 3-4 blocks: the 12-block pool must evict
        req = make_request(list(range(k * 1000, k * 1000 + 50)), max_tokens=3)
        s.add_request(req)
        for _ in range(8):
            step(s)
            s.check_integrity()
            evs = s.take_kv_events()
            seen_removed |= any(isinstance(e, BlockRemoved) for e in evs)
            replay(evs, view)
            assert view == set(s.cached_block_hashes())
    assert seen_removed, "the pool never evicted: the test did not exercise BlockRemoved"
    s.reset_prefix_cache()
    evs = s.take_kv_events()
    assert any(isinstance(e, AllBlocksCleared) for e in evs)
    replay(evs, view)
    assert view == set() == set(s.cached_block_hashes())


def test_block_stored_is_a_chain_with_parent_and_tokens() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=40)
    s.enable_kv_events()
    a = make_request(COMMON + list(range(5000, 5020)), max_tokens=2)
    s.add_request(a)
    while not a.is_finished:
        step(s)
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == a.block_hashes[: len(hashes)] and len(hashes) == 4  # 67 tokens: 4 full
    assert stored[0].parent_block_hash is None and stored[0].medium == "gpu"
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == (COMMON + list(range(5000, 5020)))[:64]
    for e in stored[1:]:
        assert e.parent_block_hash == a.block_hashes[a.block_hashes.index(e.block_hashes[0]) - 1]
    # A second request on the same prefix stores only its new blocks, chained to the prefix.
    b = make_request(COMMON + list(range(7000, 7020)), max_tokens=2)
    s.add_request(b)
    while not b.is_finished:
        step(s)
    stored = [e for e in s.take_kv_events() if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash == a.block_hashes[2]
    assert stored[0].block_hashes[0] == b.block_hashes[3]
