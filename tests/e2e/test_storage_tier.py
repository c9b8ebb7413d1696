"""The shared storage tier end to end with the `model` executor and a real Mooncake Store
(issue 25): the daemon in this process, two instances whose `model` workers move real KV block
bytes through the store over loopback TCP, every streamed token checked against
`generate_reference` (the same model, unpaged).

One instance serves a prompt and writes its blocks to the store (write_through); it leaves;
the other serves a longer prompt with the same prefix and fetches those blocks into its GPU
blocks instead of computing them. A fetch of a block from the wrong key, into the wrong block,
or after the chunk that reads it changes tokens (`test_skipped_fetch_is_detected` shows the
check can fail). A fetch that fails mid-way (its keys removed from the store between the write
and the fetch, or the master killed) preempts the request, which recomputes: tokens still equal.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvsched.storage import MooncakeStore
from kvsched.storage.server import MooncakeServer, free_port
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.worker_stub.model import paddle_import_error
from tests.e2e.harness import (
    ModelHarness,
    Node,
    Result,
    make_prompt,
    model_daemon,
    run,
    wait_until,
)
from tests.e2e.test_host_tier import seed_costs
from tests.storage.conftest import fresh_mooncake, mooncake  # noqa: F401 (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

NODES = {"i0": Node(num_gpu_blocks=64), "i1": Node(num_gpu_blocks=64)}
# Fetching a block must look cheaper than recomputing its 8 tokens (~0.17 ms by the seed
# cost model) or the scheduler declines the storage hit and recomputes.
ENGINE = {"cache.storage_write_policy": "write_through", "step_cost.per_fetched_block_ms": 0.01}
PREFIX = make_prompt(2501, 64)  # 8 blocks of 8 tokens


def _written_keys(h: ModelHarness, iid: str) -> list[str]:
    return [k for t in h.applied[iid] for k in t.storage_write_keys]


async def _stored(h: ModelHarness, iid: str, num_blocks: int) -> list[str]:
    """Wait until the daemon's storage index holds num_blocks keys iid wrote (the worker
    acknowledged the writes: with a host tier they follow the swap-outs' acknowledgements, a
    few messages after the request finished); their keys."""
    index = h.daemon.engines[iid].storage_index
    assert index is not None

    def done() -> bool:
        return sum(k in index for k in _written_keys(h, iid)) >= num_blocks

    await wait_until(done, 20.0, f"{num_blocks} blocks of {iid} stored")
    return _written_keys(h, iid)


async def _write_then_leave(h: ModelHarness) -> tuple[Result, str, str]:
    """The first request on whichever instance the router picks; its blocks are written to
    the store; that worker leaves. Returns (result, writer, the other instance)."""
    first = await h.generate("w", PREFIX + make_prompt(2502, 4), 6)
    await h.wait_pool_free()
    writer = first.instance
    other = next(i for i in NODES if i != writer)
    await _stored(h, writer, len(PREFIX) // 8)
    await h.stop_worker(writer)
    return first, writer, other


async def _status(h: ModelHarness, iid: str) -> apb.InstanceStatus:
    return await h.status(iid)


def _assert_exact(results: list[Result]) -> None:
    for r in results:
        assert r.finished is not None and r.tokens == r.expected, (
            f"{r.req_id}: run with the storage tier diverged from the reference"
        )


@pytest.fixture(params=["numpy", "paddle"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "paddle" and (error := paddle_import_error()):
        pytest.skip(f"paddle cannot be imported ({error}); install the `paddle` extra to test it")
    return str(request.param)


@pytest.mark.parametrize("host_blocks", [0, 32])
def test_prefix_written_by_one_instance_is_fetched_by_another(
    mooncake: MooncakeServer,  # noqa: F811
    backend: str,
    host_blocks: int,
) -> None:
    """With a host tier the blocks are written from host memory (after their swap-out),
    without one from GPU blocks; fetches always land in GPU blocks."""
    nodes = {i: Node(num_gpu_blocks=64, num_host_blocks=host_blocks) for i in NODES}

    async def go() -> tuple[list[Result], str, apb.InstanceStatus, Any]:
        async with model_daemon(
            nodes,
            backend=backend,
            engine={**ENGINE, "cache.host_write_policy": "write_through"},
            patch_executor=seed_costs,
            settings={"storage": mooncake.url},
        ) as h:
            first, _, other = await _write_then_leave(h)
            second = await h.generate("f", PREFIX + make_prompt(2503, 12), 8)
            await h.wait_pool_free([other])
            fetches = [t for t in h.applied[other] if t.storage_fetch_keys]
            return [first, second], other, await _status(h, other), (fetches, h.reports[other])

    results, other, st, (fetches, reports) = run(go())
    _assert_exact(results)
    assert results[1].instance == other
    assert fetches, "the second instance fetched nothing from the store"
    assert st.prefix_cache_storage_hit_tokens >= 56 and st.num_storage_fetches > 0
    assert not any(r.failed_storage_fetches for r in reports)
    if host_blocks:
        assert st.num_swap_outs > 0, "write_through to the host tier first"


def test_fetch_of_keys_removed_from_the_store_recomputes(mooncake: MooncakeServer) -> None:  # noqa: F811
    """Between the write and the fetch the store loses the keys (as its eviction would): the
    fetch fails, the worker reports it, the daemon preempts and the request recomputes."""
    prefix = make_prompt(2601, 64)

    async def go() -> tuple[list[Result], str, Any]:
        async with model_daemon(
            NODES, engine=ENGINE, patch_executor=seed_costs, settings={"storage": mooncake.url}
        ) as h:
            first = await h.generate("w", prefix + make_prompt(2602, 4), 6)
            await h.wait_pool_free()
            writer = first.instance
            other = next(i for i in NODES if i != writer)
            keys = await _stored(h, writer, len(prefix) // 8)
            await h.stop_worker(writer)
            with MooncakeStore.connect(mooncake.url) as store:
                for k in keys[2:]:  # the run's start stays: the fetch fails part-way
                    store.remove(k)
            second = await h.generate("f", prefix + make_prompt(2603, 12), 8)
            await h.wait_pool_free([other])
            return [first, second], other, (h.reports[other], await _status(h, other))

    results, other, (reports, st) = run(go())
    _assert_exact(results)
    assert results[1].instance == other
    assert any(r.failed_storage_fetches for r in reports), "the worker reported no failed fetch"
    assert st.num_storage_failures > 0 and st.num_preemptions > 0


def _kept_its_stream(h: ModelHarness, iid: str) -> tuple[int, int]:
    """(sessions the worker was welcomed to, streams it left for the daemon's silence): (1, 0)
    when its first stream never broke."""
    w = h.workers[iid]
    return w.stats.num_connects, w.guard.num_silent


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_master_down_between_write_and_fetch_recomputes_and_the_worker_keeps_its_stream(
    fresh_mooncake: MooncakeServer,  # noqa: F811
    fault: str,
) -> None:
    """The master crashes (SIGKILL: connections refused) or hangs (SIGSTOP: connections
    accepted, nothing answered) after the write: the fetch fails, the worker reports it, the
    request recomputes exactly; and the worker keeps its stream to the daemon throughout (a
    Mooncake call holding the GIL for seconds, or a step loop stuck past the daemon's silence
    bound, cost it its stream, and the request a loss before its first token)."""
    prefix = make_prompt(2701, 64)

    async def go() -> tuple[list[Result], Any, tuple[int, int]]:
        async with model_daemon(
            NODES,
            engine=ENGINE,
            patch_executor=seed_costs,
            settings={"storage": fresh_mooncake.url},
        ) as h:
            first = await h.generate("w", prefix + make_prompt(2702, 4), 6)
            await h.wait_pool_free()
            other = next(i for i in NODES if i != first.instance)
            await _stored(h, first.instance, len(prefix) // 8)
            await h.stop_worker(first.instance)
            if fault == "killed":
                fresh_mooncake.kill_master()
            else:
                fresh_mooncake.pause_master()
            second = await h.generate("f", prefix + make_prompt(2703, 12), 8)
            await h.wait_pool_free([other], timeout=30.0)
            stream = _kept_its_stream(h, other)
            fresh_mooncake.resume_master()  # the worker's client closes as it leaves
            return [first, second], h.reports[other], stream

    try:
        results, reports, stream = run(go())
    finally:
        fresh_mooncake.resume_master()
    _assert_exact(results)
    assert any(r.failed_storage_fetches for r in reports), "the worker reported no failed fetch"
    assert stream == (1, 0), f"the worker's stream broke (sessions, silence drops) = {stream}"


def test_skipped_fetch_is_detected(mooncake: MooncakeServer) -> None:  # noqa: F811
    """A worker that acknowledges fetches without writing the bytes leaves noise where the
    prefix's KV should be: the proof must see different tokens (the check can fail)."""
    prefix = make_prompt(2801, 64)

    def skip(executor: Any) -> None:
        seed_costs(executor)
        executor.storage_write = lambda gpu_ids, blobs: None

    async def go() -> list[Result]:
        async with model_daemon(
            NODES, engine=ENGINE, patch_executor=skip, settings={"storage": mooncake.url}
        ) as h:
            first = await h.generate("w", prefix + make_prompt(2802, 4), 6)
            await h.wait_pool_free()
            await _stored(h, first.instance, len(prefix) // 8)
            await h.stop_worker(first.instance)
            return [first, await h.generate("f", prefix + make_prompt(2803, 12), 8)]

    results = run(go())
    assert results[0].tokens == results[0].expected
    assert results[1].tokens != results[1].expected, "skipped fetches went unnoticed"


def _serve_without_the_store(
    url: str, caplog: pytest.LogCaptureFixture
) -> tuple[list[Result], apb.InstanceStatus, Any, tuple[int, int]]:
    prefix = make_prompt(2901, 64)

    async def go() -> tuple[list[Result], apb.InstanceStatus, Any, tuple[int, int]]:
        async with model_daemon(
            {"i0": Node(num_gpu_blocks=64)},
            engine=ENGINE,
            patch_executor=seed_costs,
            settings={"storage": url},
        ) as h:
            a = await h.generate("a", prefix + make_prompt(2902, 4), 6)
            b = await h.generate("b", prefix + make_prompt(2903, 4), 6)
            await h.wait_pool_free()
            index = h.daemon.engines["i0"].storage_index
            out = (h.reports["i0"], index)
            return [a, b], await _status(h, "i0"), out, _kept_its_stream(h, "i0")

    with caplog.at_level(logging.ERROR, logger="kvsched.worker_stub.storage_kv"):
        result: tuple[list[Result], apb.InstanceStatus, Any, tuple[int, int]] = run(go())
    return result


def _assert_served_without_the_store(
    caplog: pytest.LogCaptureFixture,
    results: list[Result],
    st: apb.InstanceStatus,
    reports: list[Any],
    index: Any,
    stream: tuple[int, int],
) -> None:
    _assert_exact(results)
    assert any("cannot connect" in r.message for r in caplog.records)
    failed = [k for r in reports for k in r.failed_storage_writes]
    assert failed and not any(k in index for k in failed)
    assert st.num_storage_failures > 0
    assert stream == (1, 0), f"the worker's stream broke (sessions, silence drops) = {stream}"


def test_unreachable_store_fails_storage_tasks_and_tokens_stay_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Welcome names a store nobody serves: the worker logs an ERROR, reports its writes
    failed (the daemon never counts them stored), and serves every request exactly."""
    url = f"mooncake://127.0.0.1:{free_port()}?metadata=127.0.0.1:{free_port()}"
    results, st, (reports, index), stream = _serve_without_the_store(url, caplog)
    _assert_served_without_the_store(caplog, results, st, reports, index, stream)


def test_store_hung_when_the_worker_connects_fails_tasks_and_keeps_the_stream(
    fresh_mooncake: MooncakeServer,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store's master hangs (SIGSTOP) before the worker connects: connecting fails
    without stopping the worker (the Mooncake client's setup holds the GIL while it waits),
    every storage task fails, requests are served exactly on the first stream."""
    fresh_mooncake.pause_master()
    try:
        results, st, (reports, index), stream = _serve_without_the_store(fresh_mooncake.url, caplog)
    finally:
        fresh_mooncake.resume_master()
    _assert_served_without_the_store(caplog, results, st, reports, index, stream)


def test_write_back_on_gpu_eviction_writes_the_blocks_before_they_are_reused(
    mooncake: MooncakeServer,  # noqa: F811
) -> None:
    """write_back without a host tier: a prefix's GPU blocks are written when the pool evicts
    them, in the message whose chunks overwrite them; the worker must put them before those
    chunks run. The other instance then fetches them: wrong bytes would change its tokens."""
    nodes = {i: Node(num_gpu_blocks=24) for i in NODES}
    engine = {"cache.storage_write_policy": "write_back", "step_cost.per_fetched_block_ms": 0.01}
    prefix = make_prompt(3001, 80)  # 10 blocks

    async def go() -> tuple[list[Result], str, apb.InstanceStatus, Any]:
        async with model_daemon(
            nodes, engine=engine, patch_executor=seed_costs, settings={"storage": mooncake.url}
        ) as h:
            first = await h.generate("p", prefix + make_prompt(3002, 3), 4)
            writer = first.instance
            other = next(i for i in NODES if i != writer)
            await h.stop_worker(other)  # the fills must land on the writer and evict
            fills = [await h.generate(f"x{k}", make_prompt(3010 + k, 150), 2) for k in range(2)]
            await h.wait_pool_free([writer])
            evicted = [
                t for t in h.applied[writer] if set(t.storage_write_blocks) & _fresh_blocks(t)
            ]
            await _stored(h, writer, 10)
            await h.stop_worker(writer)
            h.start_worker(other)
            await h.wait_ready([other])
            second = await h.generate("f", prefix + make_prompt(3003, 9), 8)
            await h.wait_pool_free([other])
            st = await _status(h, other)
            return [first, *fills, second], other, st, evicted

    results, other, st, evicted = run(go())
    _assert_exact(results)
    assert results[-1].instance == other
    assert evicted, "no write shared a message with chunks into the blocks it wrote"
    assert st.prefix_cache_storage_hit_tokens >= 64 and st.num_storage_failures == 0


def _fresh_blocks(t: Any) -> set[int]:
    """GPU blocks a Tasks message gives out to be written (placements past their cached
    tokens, extensions)."""
    out = {b for p in t.placements for b in p.block_ids[p.num_cached_tokens // 8 :]}
    return out | {b for e in t.extensions for b in e.block_ids}
