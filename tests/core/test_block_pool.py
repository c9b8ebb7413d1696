from kvsched.core import BlockPool


def test_allocate_free_counts_and_none_when_exhausted() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # unchanged
    pool.free(a)
    assert pool.num_free == 4
    pool.check_integrity({})


def test_ref_counts_and_touch_remove_cached_block_from_free_list() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    assert pool.cache_block(b, b"h0")
    pool.free([b])
    assert pool.ref_cnt[b] == 0 and b in pool.free_order()
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_cnt[b] == 2 and b not in pool.free_order()
    pool.check_integrity({b: 2})


def test_evicted_block_loses_its_hash() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    pool.cache_block(x, b"hx")
    pool.free([x, y])
    # y is uncached: it goes to the head and is taken first; x (cached) is taken next.
    assert pool.free_order() == [y, x]
    assert pool.allocate(2) == [y, x]
    assert pool.lookup(b"hx") is None and pool.block_hash[x] is None
    pool.check_integrity({x: 1, y: 1})


def test_duplicate_content_is_not_registered_twice() -> None:
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, b"same")
    assert not pool.cache_block(y, b"same")
    assert pool.lookup(b"same") == x and pool.block_hash[y] is None


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    (x,) = pool.allocate(1)
    assert not pool.cache_block(x, b"h")
    assert pool.lookup(b"h") is None


def test_integrity_check_can_fail() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    try:
        pool.check_integrity({a[0]: 1})  # a[1] owned by nobody but ref 1
    except AssertionError:
        return
    raise AssertionError("check_integrity missed a leaked block")
