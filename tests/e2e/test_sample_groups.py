"""n = 8 samples of a 1,000-token prompt (GenerateRequest.sample_group, issue 35) through the
daemon and a real `model` worker: the worker computes the prompt once (its prompt-token
counter), the samples' block tables share the prompt's blocks, every sample's tokens equal the
unpaged reference (so the shared KV is the right KV), and every block comes back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from tests.e2e.harness import (
    ModelHarness,
    Node,
    Result,
    make_prompt,
    model_daemon,
    run,
    wait_until,
)

LENGTH = common_pb2.FINISH_REASON_LENGTH
N, PROMPT_LEN, MAX_TOKENS, BS = 8, 1000, 16, 8


async def _sample(h: ModelHarness, req: rpb.GenerateRequest) -> Result:
    out = Result(req.request_id, list(req.prompt_token_ids), req.sampling.max_tokens)
    async for r in h.stub.Generate(req, timeout=60.0):
        kind = r.WhichOneof("kind")
        if kind == "queued":
            out.instance = r.queued.instance
        elif kind == "tokens":
            out.tokens.extend(r.tokens.token_ids)
        elif kind == "finished":
            out.finished = r.finished
    return out


def test_eight_samples_of_a_1000_token_prompt_compute_it_once_and_share_its_blocks() -> None:
    prompt = make_prompt(35, PROMPT_LEN)
    reqs = [
        rpb.GenerateRequest(
            request_id=f"s{i}",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=i),
            sample_group="g-35",
        )
        for i in range(N)
    ]

    async def go() -> tuple[list[Result], int, dict[int, list[int]]]:
        # Two instances: the samples must all go where the first computes the prompt.
        # The prompt in chunks of 128 over several steps, with room in each step for more:
        # samples that did not wait for it would be admitted beside it and compute their own.
        engine = {"scheduler.long_prefill_token_threshold": 128}
        async with model_daemon({"i0": Node(), "i1": Node()}, block_size=BS, engine=engine) as h:
            # All at once: whichever the daemon accepts first leads, the others wait for it.
            results = list(await asyncio.gather(*(_sample(h, r) for r in reqs)))
            await h.wait_pool_free()
            where = results[0].instance
            assert all(r.instance == where for r in results)
            tables: dict[int, list[int]] = {}  # handle -> its block table, as the worker got it
            for t in h.applied[where]:
                for p in t.placements:
                    tables[p.handle] = list(p.block_ids)
                for e in t.extensions:
                    tables[e.handle] += e.block_ids
            computed = sum(w.stats.num_prefill_tokens for w in h.workers.values())
            return results, computed, tables

    results, computed, tables = run(go())
    full = (PROMPT_LEN - 1) // BS  # the last prompt token is always recomputed (rule 5)
    tail = PROMPT_LEN - full * BS
    for r in results:
        assert r.reason == LENGTH and r.tokens == r.expected, r.req_id
    assert computed == PROMPT_LEN + (N - 1) * tail  # the prompt once, then 7 tails of 8
    cached = sorted(r.finished.usage.cached_tokens for r in results)  # type: ignore[union-attr]
    assert cached == [0] + [full * BS] * (N - 1)
    assert [r.finished.usage.prompt_tokens for r in results] == [PROMPT_LEN] * N  # type: ignore[union-attr]
    assert len(tables) == N
    first = next(iter(tables.values()))
    assert all(t[:full] == first[:full] for t in tables.values())  # the prompt's blocks, once


def test_a_lost_instance_moves_the_group_and_the_prompt_is_computed_once_there() -> None:
    """The instance computing a group's prompt is lost while three samples wait for it: all
    four move to the other instance, which computes the prompt once for them, and each ends
    with the reference's tokens; every block comes back."""
    prompt = make_prompt(36, PROMPT_LEN)
    reqs = [
        rpb.GenerateRequest(
            request_id=f"m{i}",
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            sample_group="g-lost",
        )
        for i in range(4)
    ]

    def slow(executor: Any) -> None:  # 30 ms a step: the prompt takes several steps
        execute = executor.execute

        def slowed(work: Any) -> Any:
            time.sleep(0.03)
            return execute(work)

        executor.execute = slowed

    async def go() -> tuple[list[Result], str, int]:
        engine = {"scheduler.long_prefill_token_threshold": 128}
        nodes = {"i0": Node(), "i1": Node()}
        async with model_daemon(nodes, block_size=BS, engine=engine, patch_executor=slow) as h:
            runs = [asyncio.ensure_future(_sample(h, r)) for r in reqs]
            engines = h.daemon.engines

            def held_somewhere() -> str:  # (the four arrive one by one: wait for all three)
                return next(
                    (i for i, e in engines.items() if e.sched and e.sched.num_held == 3), ""
                )

            await wait_until(lambda: bool(held_somewhere()), 30, "three samples held")
            lost = held_somewhere()
            before = {i: w.stats.num_prefill_tokens for i, w in h.workers.items()}
            await h.stop_worker(lost)
            results = list(await asyncio.gather(*runs))
            other = next(i for i in nodes if i != lost)
            await h.wait_pool_free([other])
            return results, lost, h.workers[other].stats.num_prefill_tokens - before[other]

    results, lost, computed = run(go())
    full = (PROMPT_LEN - 1) // BS
    for r in results:
        assert r.reason == LENGTH and r.tokens == r.expected, r.req_id
        assert r.instance == lost  # (where it was queued; it finished elsewhere)
    assert computed == PROMPT_LEN + 3 * (PROMPT_LEN - full * BS)
