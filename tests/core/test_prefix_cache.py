"""Prefix caching scenarios, re-expressed from vLLM v1's test_prefix_caching.py against our API."""

from kvsched.core import Request
from tests.core.factories import make_request, make_scheduler, mm, run_tasks, step

COMMON = list(range(1000, 1048))  # 48 tokens = 3 blocks of 16


def _prefill(s, req: Request) -> None:
    s.add_request(req)
    while not req.output_token_ids:
        step(s)


def test_shared_48_token_prefix_hits_three_blocks_and_frees_shared_chain_last() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=20)
    a = make_request(COMMON + list(range(5000, 5010)), max_tokens=4)
    _prefill(s, a)
    b = make_request(COMMON + list(range(6000, 6010)), max_tokens=4)
    s.add_request(b)
    tasks = s.schedule()
    (pl,) = tasks.placements
    assert pl.req_id == b.req_id and pl.num_cached_tokens == 48
    assert tasks.chunks[0].start == 48 and b.num_cached_tokens == 48
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared
    assert [s.kv.pool.ref_cnt[x] for x in shared] == [2, 2, 2]
    assert s.kv.num_queries == 58 + 58 and s.kv.num_hits == 48
    run_tasks(s, tasks)
    s.check_integrity()
    s.abort(a.req_id)
    s.abort(b.req_id)
    s.check_integrity()
    order = s.kv.pool.free_order()
    assert order[-3:] == shared[::-1], "shared chain must be evicted last, tail first"
    hashed = [x for x in order if s.kv.pool.block_hash[x] is not None]
    assert order[-len(hashed) :] == hashed, "uncached blocks are evicted before cached ones"


def test_hit_touches_lru_and_hit_blocks_are_protected_from_eviction() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=12, prealloc_threshold=0, prealloc_blocks=1)
    a = make_request(COMMON + [1], max_tokens=1)  # finishes at its first token
    _prefill(s, a)
    assert a.is_finished
    x = make_request(list(range(7000, 7033)), max_tokens=1)  # 3 blocks, other content
    _prefill(s, x)
    pool = s.kv.pool
    cached_a = [pool.lookup(h) for h in a.block_hashes[:3]]
    cached_x = [pool.lookup(h) for h in x.block_hashes[:2]]
    assert None not in cached_a and None not in cached_x
    # a's chain was freed before x's, so it is older: a hit on it must make it the newest.
    b = make_request(COMMON + [2, 3], max_tokens=4)
    s.add_request(b)
    step(s)
    assert b.block_ids[:3] == cached_a
    s.abort(b.req_id)
    order = pool.free_order()
    assert order.index(cached_a[0]) > order.index(cached_x[0]), "the hit was not touched"
    # While held, hit blocks cannot be evicted: fill the pool and check they survive.
    c = make_request(COMMON + [9], max_tokens=4)
    s.add_request(c)
    step(s)
    free_now = pool.num_free
    grabbed = pool.allocate(free_now)
    assert grabbed is not None and not set(grabbed) & set(c.block_ids)
    assert all(pool.lookup(h) == blk for h, blk in zip(c.block_hashes[:3], cached_a, strict=True))
    pool.free(grabbed)


def test_evicted_and_reused_block_loses_hash_and_gives_no_hit() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=6, prealloc_threshold=0, prealloc_blocks=1)
    a = make_request(COMMON + [1], max_tokens=1)
    _prefill(s, a)
    assert s.kv.pool.lookup(a.block_hashes[0]) is not None
    big = make_request(list(range(9000, 9000 + 16 * 5 + 4)), max_tokens=4)  # needs every block
    _prefill(s, big)
    assert all(s.kv.pool.lookup(h) is None for h in a.block_hashes[:3])
    while not big.is_finished:
        step(s)
    again = make_request(COMMON + [1], max_tokens=1)
    s.add_request(again)
    tasks = s.schedule()
    assert tasks.placements[0].num_cached_tokens == 0


def test_caching_disabled_gives_no_hits_and_none_when_exhausted() -> None:
    s = make_scheduler(block_size=16, num_gpu_blocks=8, enable_prefix_caching=False)
    a = make_request(COMMON + [1], max_tokens=1)
    _prefill(s, a)
    b = make_request(COMMON + [1], max_tokens=1)
    s.add_request(b)
    tasks = s.schedule()
    assert tasks.placements[0].num_cached_tokens == 0 and s.kv.num_hits == 0
    big = make_request(list(range(9000, 9000 + 16 * 20)), max_tokens=1)
    assert s.kv.allocate_slots(big, 16 * 20) is None and big.block_ids == []
    s.check_integrity()


def test_full_prompt_hit_recomputes_the_last_token() -> None:
    s = make_scheduler(block_size=16)
    a = make_request(COMMON, max_tokens=2)
    _prefill(s, a)
    b = make_request(COMMON, max_tokens=2)
    s.add_request(b)
    tasks = s.schedule()
    # 48 tokens all cached, but the last block is recomputed so the worker gets logits.
    assert tasks.placements[0].num_cached_tokens == 32
    assert tasks.chunks[0].start == 32 and len(tasks.chunks[0].token_ids) == 16


def test_cache_salt_is_only_in_the_first_blocks_hash() -> None:
    s = make_scheduler(block_size=16)
    salted = make_request(COMMON, cache_salt="tenant-a")
    plain = make_request(COMMON)
    kv = s.kv
    assert b"salt=tenant-a" in kv.block_extra_keys(salted, 0)
    assert kv.block_extra_keys(salted, 1) == kv.block_extra_keys(plain, 1) == b""
    a = make_request(COMMON + [1], cache_salt="tenant-a", max_tokens=1)
    _prefill(s, a)
    for salt, expect in (("tenant-a", 48), ("tenant-b", 0), ("", 0)):
        r = make_request(COMMON + [2], cache_salt=salt)
        s.add_request(r)
        tasks = s.schedule()
        assert tasks.placements[0].num_cached_tokens == expect, salt
        run_tasks(s, tasks)
        s.abort(r.req_id)


def test_multimodal_content_hash_is_part_of_the_overlapping_blocks_keys() -> None:
    s = make_scheduler(block_size=16)
    prompt = list(range(64))  # image placeholder tokens at [20, 40) are identical in both
    cat = make_request(prompt, mm_ranges=[mm(20, 20, "cat")])
    dog = make_request(prompt, mm_ranges=[mm(20, 20, "dog")])
    s.kv.ensure_hashes(cat, 4)
    s.kv.ensure_hashes(dog, 4)
    assert cat.block_hashes[0] == dog.block_hashes[0]  # block 0: tokens 0-15, no image
    assert cat.block_hashes[1] != dog.block_hashes[1]  # block 1 overlaps the image
    assert s.kv.block_extra_keys(cat, 2) == b"mm=cat@12"  # block 2 starts 12 tokens in
    _prefill(s, make_request(prompt, mm_ranges=[mm(20, 20, "cat")], max_tokens=1))
    r = make_request(prompt, mm_ranges=[mm(20, 20, "dog")])
    s.add_request(r)
    assert s.schedule().placements[0].num_cached_tokens == 16


def test_lora_name_separates_caches() -> None:
    s = make_scheduler(block_size=16)
    _prefill(s, make_request(COMMON + [1], lora_name="sql", max_tokens=1))
    r = make_request(COMMON + [1], lora_name="chat")
    s.add_request(r)
    assert s.schedule().placements[0].num_cached_tokens == 0


def test_block_is_a_hit_only_after_its_write_is_reported() -> None:
    s = make_scheduler(block_size=16)
    a = make_request(COMMON + [1], max_tokens=2)
    s.add_request(a)
    s.schedule()  # a's prefill is in flight, not reported
    b = make_request(COMMON + [2], max_tokens=2)
    s.add_request(b)
    tasks = s.schedule()
    assert tasks.placements[0].num_cached_tokens == 0, "read KV from a step not yet executed"


def test_a_request_whose_sampling_reads_its_prompt_takes_no_hit() -> None:
    """A repetition penalty reads the prompt's token ids; a worker learns them only from the
    chunks it computes, so such a request gets no prefix hit and sends its whole prompt (an
    identical request without the penalty still hits what it cached)."""
    s = make_scheduler(block_size=16, num_gpu_blocks=40)
    a = make_request(COMMON + [1], max_tokens=4)
    _prefill(s, a)
    b = make_request(COMMON + [2], max_tokens=4)
    b.sampling.repetition_penalty = 1.2
    s.add_request(b)
    assert s.prefix_hit_tokens(b) == 0
    tasks = s.schedule()
    (pl,) = tasks.placements
    assert pl.num_cached_tokens == 0 and tasks.chunks[0].start == 0
    assert tasks.chunks[0].token_ids[:48] == COMMON
    run_tasks(s, tasks)
    s.check_integrity()
    c = make_request(COMMON + [3], max_tokens=4)
    s.add_request(c)
    (pl,) = s.schedule().placements
    assert pl.num_cached_tokens == 48
