"""The host-memory KV tier end to end with the `model` executor (issue 13).

The daemon runs in this process with real `Worker`s whose `model` executor holds a host KV pool
(numpy arrays) next to its paged GPU cache, over real gRPC streams. Prefixes leave the GPU pool
(evicted, or copied by the write policy), come back by swap-in, and every streamed token must
equal `generate_reference` (the same model unpaged): a copy to or from the wrong block, a copy
run after the chunk that reads it, or a swap-in of a block the daemon had forgotten changes
tokens. `test_skipped_swap_in_is_detected` shows the check can fail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsched.core.protocol import Tasks
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.worker_stub.model import paddle_import_error
from tests.e2e.harness import ModelHarness, Node, Result, make_prompt, model_daemon, run

pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

POLICIES = ["write_through", "write_through_selective", "write_back"]
BS = 8  # the harness's block size


@pytest.fixture(params=["numpy", "paddle"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "paddle" and (error := paddle_import_error()):
        pytest.skip(f"paddle cannot be imported ({error}); install the `paddle` extra to test it")
    return str(request.param)


def seed_costs(executor: Any) -> None:
    """Report every step as untimed: the daemon's step-cost model keeps its seed, so whether a
    host hit is swapped in or recomputed does not depend on how loaded this machine is."""
    real = executor.execute

    def execute(work: Any) -> Any:
        result = real(work)
        result.step_time_s = 0.0
        return result

    executor.execute = execute


def assert_exact(results: list[Result]) -> None:
    for r in results:
        assert r.finished is not None and r.tokens == r.expected, (
            f"{r.req_id}: paged run with a host tier diverged from the reference"
        )


def conversations(n: int, seed: int) -> list[list[list[int]]]:
    """n conversations of three turns; each turn's prompt extends the previous one."""
    out = []
    for c in range(n):
        base = make_prompt(seed * 100 + c, 48)
        turns = [base + make_prompt(seed * 100 + c + 50, 4)]
        turns.append(base + make_prompt(seed * 100 + c + 60, 16))
        turns.append(turns[1] + make_prompt(seed * 100 + c + 70, 16))
        out.append(turns)
    return out


async def run_conversations(h: ModelHarness, convs: list[list[list[int]]]) -> list[Result]:
    """Turns 1 and 2 of each conversation one after another (turn 2 hits turn 1's blocks on
    the GPU), then every turn 3, latest conversation first: by then the early conversations
    left the GPU pool (and the earliest the host tier too)."""
    results = []
    for c, turns in enumerate(convs):
        for t in (0, 1):
            results.append(await h.generate(f"c{c}t{t}", turns[t], 8))
    for c in reversed(range(len(convs))):
        results.append(await h.generate(f"c{c}t2", convs[c][2], 8))
    return results


def blocks_written(t: Tasks) -> set[int]:
    """GPU blocks a Tasks message gives out to be written (fresh in placements, extensions,
    swap-in targets)."""
    out = {b for p in t.placements for b in p.block_ids[p.num_cached_tokens // BS :]}
    out |= {b for e in t.extensions for b in e.block_ids}
    return out | set(t.swap_in_gpu)


@pytest.mark.parametrize("policy", POLICIES)
def test_prefixes_leave_the_gpu_and_come_back_from_a_small_host_tier(
    backend: str, policy: str
) -> None:
    """GPU pool of 24 blocks, host tier of 32: six conversations of ~10 blocks overflow both,
    so blocks are evicted from the host tier too. Turn 3 of the early conversations hits in
    host memory: swapped in, and the first chunk starts after the swapped-in range."""
    nodes = {"i0": Node(num_gpu_blocks=24, num_host_blocks=32)}
    engine = {"cache.host_write_policy": policy}

    async def go() -> tuple[list[Result], apb.InstanceStatus, list[Tasks]]:
        async with model_daemon(
            nodes, backend=backend, engine=engine, patch_executor=seed_costs
        ) as h:
            results = await run_conversations(h, conversations(6, seed=1))
            await h.wait_pool_free()
            return results, await h.status("i0"), h.applied["i0"]

    results, st, applied = run(go())
    assert_exact(results)
    host_ids = [hb for t in applied for hb in t.swap_out_host]
    assert st.num_host_blocks == 32 and len(set(host_ids)) < len(host_ids), (
        "no host block was written twice: the host tier evicted nothing"
    )
    assert st.num_swap_ins > 0 and st.prefix_cache_host_hit_tokens > 0
    assert st.prefix_cache_hit_tokens >= st.prefix_cache_host_hit_tokens
    # A swap-in and its request's first chunk travel in one message: the worker applies the
    # copies before it runs that chunk in its next step.
    assert any(set(t.swap_in_handles) & {c.handle for c in t.chunks} for t in applied)
    for t in applied:
        for p in t.placements:
            swapped = t.swap_in_gpu and set(p.block_ids) & set(t.swap_in_gpu)
            if swapped:
                starts = [c.start for c in t.chunks if c.handle == p.handle]
                assert starts == [p.num_cached_tokens], "the chunk starts after the swap-ins"
    if policy == "write_back":
        # Evicted blocks are copied out in the same message whose tasks overwrite them.
        assert any(set(t.swap_out_gpu) & blocks_written(t) for t in applied)


def test_preemptions_and_resets_while_swaps_are_in_flight(backend: str) -> None:
    """A pool too small for the concurrent requests (they preempt each other and recompute)
    with a host tier; ResetPrefixCache twice while copies are under way. The worker refills its
    host pool with noise on every reset: a swap-in of a block the daemon forgot would show."""
    nodes = {"i0": Node(num_gpu_blocks=20, num_host_blocks=32, num_slots=6)}
    engine = {"cache.host_write_policy": "write_through", "scheduler.max_num_batched_tokens": 48}
    convs = conversations(8, seed=2)

    async def go() -> tuple[list[Result], apb.InstanceStatus]:
        async with model_daemon(
            nodes, backend=backend, engine=engine, patch_executor=seed_costs
        ) as h:
            first = await asyncio.gather(  # 52-token prompts growing to 92: preemptions
                *(h.generate(f"a{c}", turns[0], 40) for c, turns in enumerate(convs))
            )

            async def resets() -> None:
                for _ in range(2):
                    await asyncio.sleep(0.05)
                    await h.admin.ResetPrefixCache(apb.ResetPrefixCacheRequest(), timeout=5.0)

            second, _ = await asyncio.gather(
                asyncio.gather(
                    *(h.generate(f"b{c}", turns[2], 12) for c, turns in enumerate(convs))
                ),
                resets(),
            )
            third = await asyncio.gather(
                *(h.generate(f"c{c}", turns[1], 12) for c, turns in enumerate(convs))
            )
            await h.wait_pool_free()
            return [*first, *second, *third], await h.status("i0")

    results, st = run(go())
    assert_exact(results)
    assert st.num_preemptions > 0, "the pool was meant to be too small"
    assert st.num_swap_outs > 0 and st.num_swap_ins > 0


def test_failed_swap_ins_recompute_to_the_same_tokens() -> None:
    """The worker fails its first two swap-ins: those requests are preempted and recompute
    their prompts; nothing is lost and every token is still the reference's."""
    nodes = {"i0": Node(num_gpu_blocks=24, num_host_blocks=32)}
    engine = {"cache.host_write_policy": "write_back"}

    def fail_two(executor: Any) -> None:
        real, calls = executor.swap_in, [0]

        def swap_in(host_ids: list[int], gpu_ids: list[int]) -> None:
            calls[0] += 1
            if calls[0] <= 2:
                raise RuntimeError("injected swap-in failure")
            real(host_ids, gpu_ids)

        seed_costs(executor)
        executor.swap_in = swap_in

    async def go() -> tuple[list[Result], apb.InstanceStatus]:
        async with model_daemon(nodes, engine=engine, patch_executor=fail_two) as h:
            results = await run_conversations(h, conversations(6, seed=3))
            await h.wait_pool_free()
            return results, await h.status("i0")

    results, st = run(go())
    assert_exact(results)
    assert st.num_swap_failures > 0 and st.num_swap_ins > st.num_swap_failures  # blocks
    assert st.num_preemptions >= 2, "each failed swap-in preempts its request"


def test_skipped_swap_in_is_detected() -> None:
    """A worker that acknowledges swap-ins without copying leaves noise where the prefix's KV
    should be: the proof must see different tokens (the check can fail)."""
    nodes = {"i0": Node(num_gpu_blocks=24, num_host_blocks=32)}
    engine = {"cache.host_write_policy": "write_back"}

    def skip(executor: Any) -> None:
        seed_costs(executor)
        executor.swap_in = lambda host_ids, gpu_ids: None

    async def go() -> tuple[list[Result], apb.InstanceStatus]:
        async with model_daemon(nodes, engine=engine, patch_executor=skip) as h:
            results = await run_conversations(h, conversations(6, seed=1))
            return results, await h.status("i0")

    results, st = run(go())
    assert st.num_swap_ins > 0
    wrong = [r.req_id for r in results if r.tokens != r.expected]
    assert wrong, "skipped swap-ins went unnoticed: the proof cannot see host tier bugs"
