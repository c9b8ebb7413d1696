"""The multimodal encoder cache end to end with the `model` executor (issue 13).

The daemon runs in this process with real `Worker`s over real gRPC streams. Requests carry
image-like items (placeholder ranges with a content hash); the worker's stand-in encoder turns
an item into embeddings that replace the placeholder tokens' embeddings, and keeps them until
the daemon's `Tasks.encoder_drops` (or a prefix-cache reset) names the item. Every streamed
token must equal `generate_reference`, which encodes every item afresh. Items are shared
across requests (the daemon counts hits and charges no encoder budget for them), the cache is
small enough to evict from, and the prefix cache is reset mid-run.

Beyond token equality, `assert_worker_agrees` checks the worker against the daemon's books:
it encoded exactly as many items as the daemon counted misses, and holds only items the
daemon believes it holds. A worker that kept (and used) an item the daemon dropped encodes
less: `test_a_worker_that_uses_dropped_items_is_caught` shows that check failing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsched.core import Scheduler
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.worker_stub.model import paddle_import_error
from tests.e2e.harness import Item, ModelHarness, Node, Result, make_prompt, model_daemon, run

pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

CAPACITY = 48  # embeddings: three 16-embedding items
ENGINE = {"cache.encoder_cache_size": CAPACITY, "scheduler.max_num_encoder_tokens": 32}
ITEMS = ["cat", "dog", "owl", "fox"]  # four items: a cache of three evicts


@pytest.fixture(params=["numpy", "paddle"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "paddle" and (error := paddle_import_error()):
        pytest.skip(f"paddle cannot be imported ({error}); install the `paddle` extra to test it")
    return str(request.param)


def image_request(i: int, item: str) -> tuple[list[int], tuple[Item, ...]]:
    """A 40-token prompt of its own text with a 16-token item at position 8."""
    return make_prompt(1000 + i, 40), ((8, 16, item),)


class Executors:
    """Collects each worker's executor as its engine is built (patch_executor)."""

    def __init__(self, keep_dropped: bool = False) -> None:
        self.keep_dropped = keep_dropped
        self.built: list[Any] = []

    def __call__(self, executor: Any) -> None:
        executor.encoder.keep_dropped = self.keep_dropped
        self.built.append(executor)


def assert_exact(results: list[Result]) -> None:
    for r in results:
        assert r.finished is not None and r.tokens == r.expected, (
            f"{r.req_id}: paged run with cached encoder outputs diverged from the reference"
        )


def assert_worker_agrees(sched: Scheduler, executor: Any, resets: int = 0) -> None:
    """The worker's encoder cache against the daemon's account of it."""
    enc, out = sched.enc, executor.encoder
    assert enc is not None
    if not resets:  # (after a reset the worker re-encodes what queued chunks still read)
        assert out.encodes == enc.stats.misses, (
            f"worker encoded {out.encodes} items, the daemon counted {enc.stats.misses} misses: "
            "the worker used an item the daemon had dropped (or dropped one it still needed)"
        )
    assert set(out.items) <= set(enc.items), (
        f"worker holds items the daemon dropped: {sorted(set(out.items) - set(enc.items))}"
    )
    assert out.used <= CAPACITY


async def scenario(h: ModelHarness) -> list[Result]:
    """Items shared across requests, one after another and concurrently; the four items
    rotate through a cache of three."""
    results = []
    order = ["cat", "dog", "cat", "owl", "fox", "cat", "dog", "dog", "owl", "cat"]
    for i, item in enumerate(order):
        prompt, mm = image_request(i, item)
        results.append(await h.generate(f"s{i}", prompt, 6, mm=mm))
    batch = []
    for i in range(8):
        prompt, mm = image_request(100 + i, ITEMS[i % 4])
        batch.append(h.generate(f"c{i}", prompt, 6, mm=mm))
    results.extend(await asyncio.gather(*batch))
    return results


def test_shared_items_eviction_and_reuse_give_reference_tokens(backend: str) -> None:
    executors = Executors()

    async def go() -> None:
        nodes = {"i0": Node(num_slots=4)}
        async with model_daemon(
            nodes, backend=backend, engine=ENGINE, patch_executor=executors
        ) as h:
            results = await scenario(h)
            await h.wait_pool_free()
            sched = h.daemon.engines["i0"].sched
            assert_exact(results)
            enc = sched.enc
            assert enc is not None
            assert enc.stats.hits > 0 and enc.stats.evictions > 0
            assert any(t.encoder_drops for t in h.applied["i0"]), "no drop reached the worker"
            assert_worker_agrees(sched, executors.built[-1])
            sched.check_integrity()

    run(go())


def test_reset_drops_every_encoder_output() -> None:
    executors = Executors()

    async def go() -> None:
        async with model_daemon(engine=ENGINE, patch_executor=executors) as h:
            sched = h.daemon.engines["i0"].sched
            p1, mm1 = image_request(1, "cat")
            first = [await h.generate("a", p1, 6, mm=mm1)]
            assert sched.enc is not None and "cat" in sched.enc
            await h.admin.ResetPrefixCache(apb.ResetPrefixCacheRequest(), timeout=5.0)
            prompt, mm = image_request(2, "cat")
            second = await h.generate("b", prompt, 6, mm=mm)
            await h.wait_pool_free()
            assert_exact([*first, second])
            assert sched.enc.stats.misses == 2 and sched.enc.stats.hits == 0  # cat again
            assert executors.built[-1].encoder.encodes == 2  # the worker forgot it too
            assert_worker_agrees(sched, executors.built[-1], resets=1)

    run(go())


def test_a_worker_that_uses_dropped_items_is_caught() -> None:
    """The same scenario with a worker that ignores encoder_drops: its tokens still match (the
    stand-in encoder is deterministic), but the check against the daemon's books fails."""
    executors = Executors(keep_dropped=True)

    async def go() -> None:
        async with model_daemon(
            {"i0": Node(num_slots=4)}, engine=ENGINE, patch_executor=executors
        ) as h:
            await scenario(h)
            await h.wait_pool_free()
            sched = h.daemon.engines["i0"].sched
            with pytest.raises(AssertionError, match="used an item the daemon had dropped"):
                assert_worker_agrees(sched, executors.built[-1])

    run(go())


def test_items_change_tokens() -> None:
    """The proof is sensitive to items: the same prompt with another item (or none) gives
    other tokens in the reference, and the paged run follows each."""

    async def go() -> None:
        async with model_daemon(engine=ENGINE) as h:
            prompt = make_prompt(7, 40)
            runs = [
                await h.generate("plain", prompt, 8),
                await h.generate("cat", prompt, 8, mm=((8, 16, "cat"),)),
                await h.generate("dog", prompt, 8, mm=((8, 16, "dog"),)),
            ]
            await h.wait_pool_free()
            assert_exact(runs)
            assert len({tuple(r.tokens) for r in runs}) == 3

    run(go())
