"""The daemon end to end with the `model` executor (issue 4).

Each test starts the daemon in this process on 127.0.0.1:0 with real `Worker`s running the
seeded transformer over real gRPC streams, sends requests through RequestService.Generate, and
asserts that every streamed token equals `generate_reference` (the same model run unpaged) on the
same prompt. The worker keeps K/V only in the blocks the daemon's tables name, so a scheduling bug
that corrupts KV shows up as a token mismatch; `test_corrupted_block_table_is_detected` shows
the check can fail. The last test runs `kvsched serve` and `kvsched worker --executor model` as
real processes.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from kvsched.core.protocol import Tasks
from kvsched.core.request import Request
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.worker_stub.engine import ngram_draft
from kvsched.worker_stub.model import paddle_import_error
from tests.e2e.harness import (
    ModelHarness,
    Node,
    Result,
    generate_request,
    make_prompt,
    model_daemon,
    reference,
    run,
    wait_until,
)
from tests.integration import harness as procs

# importing paddle warns that ccache (for building C++ extensions) is missing: irrelevant here
pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
ERROR = common_pb2.FINISH_REASON_ERROR


@pytest.fixture(params=["numpy", "paddle"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "paddle" and (error := paddle_import_error()):
        pytest.skip(f"paddle cannot be imported ({error}); install the `paddle` extra to test it")
    return str(request.param)


def assert_matches_reference(results: list[Result]) -> None:
    """Every request ran to max_tokens and streamed exactly the reference's tokens."""
    for r in results:
        assert r.reason == LENGTH, f"{r.req_id}: {r.finished}"
        assert r.tokens == r.expected, f"{r.req_id}: paged run diverged from the reference"


async def generate_all(h: ModelHarness, specs: list[tuple[str, list[int], int]]) -> list[Result]:
    return list(await asyncio.gather(*(h.generate(*s) for s in specs)))


def varied_requests(n: int, seed: int, prefix: str = "r") -> list[tuple[str, list[int], int]]:
    """n requests: prompts of 20-200 tokens, 8-40 output tokens, reproducible per seed."""
    rng = random.Random(seed)
    return [
        (f"{prefix}{i}", make_prompt(seed * 1000 + i, rng.randint(20, 200)), rng.randint(8, 40))
        for i in range(n)
    ]


# ---- (1) chunked prefill ---------------------------------------------------------------------


def test_chunked_prefill_with_small_budgets_matches_reference(backend: str) -> None:
    engine = {"scheduler.max_num_batched_tokens": 32, "scheduler.long_prefill_token_threshold": 13}

    async def go() -> tuple[list[Result], ModelHarness]:
        async with model_daemon(backend=backend, engine=engine) as h:
            results = await generate_all(h, varied_requests(8, seed=1))
            await h.wait_pool_free()
            return results, h

    results, h = run(go())
    assert_matches_reference(results)
    executor: Any = h.workers["i0"].engine.executor  # type: ignore[union-attr]
    assert executor.backend.name == backend
    rows = [n for rep in h.reports["i0"] for n in rep.num_new_tokens]
    assert rows.count(0) >= 8 * 2, "prompts should run in several chunks each"
    # 13-token caps never end on a block boundary: chunks straddle blocks.
    chunk_ends = {c for rep in h.reports["i0"] for c in rep.num_computed if c % 8}
    assert chunk_ends
    assert all(rep.step_time_ns > 0 for rep in h.reports["i0"] if rep.handles)  # measured


# ---- (2) shared prefixes ---------------------------------------------------------------------


def test_shared_prefixes_and_full_prompt_hits_match_reference(backend: str) -> None:
    bs = 8
    prefix = make_prompt(200, 96)  # 12 full blocks
    engine = {"scheduler.max_num_batched_tokens": 64}

    async def go() -> dict[str, Result]:
        async with model_daemon(backend=backend, engine=engine) as h:
            warm = await h.generate("warm", prefix + make_prompt(201, 9), 16)
            again = await h.generate("again", warm.prompt, 16)  # the whole prompt cached
            exact = await h.generate("exact", prefix, 12)  # a prompt of only cached blocks
            turn2 = await h.generate("turn2", warm.prompt + warm.tokens + make_prompt(202, 7), 10)
            # Many at once on the warm prefix; three more sharing a prefix nobody wrote yet
            # (none may read the others' blocks before a report says they are written).
            fresh = make_prompt(203, 40)
            specs = [
                (f"s{i}", prefix + make_prompt(210 + i, 5 + 7 * i), 8 + 4 * i) for i in range(6)
            ]
            specs += [(f"f{i}", fresh + make_prompt(220 + i, 3 + i), 20) for i in range(3)]
            batch = await generate_all(h, specs)
            await h.wait_pool_free()
            st = await h.status("i0")
            assert st.prefix_cache_hit_tokens > 0
            return {r.req_id: r for r in [warm, again, exact, turn2, *batch]}

    results = run(go())
    assert_matches_reference(list(results.values()))
    cached = {rid: r.finished.usage.cached_tokens for rid, r in results.items() if r.finished}
    assert cached["warm"] == 0
    n = len(results["again"].prompt)
    assert cached["again"] == (n - 1) // bs * bs > 0  # a full hit recomputes the last token
    assert cached["exact"] == 96 - bs
    # Blocks written while decoding "warm" were cached too: the hit runs past its prompt.
    assert cached["turn2"] > len(results["warm"].prompt)
    assert all(cached[f"s{i}"] >= 96 for i in range(6))


def test_prefix_hit_waits_for_the_writers_report() -> None:
    """A cached block becomes a prefix hit only once the step writing it has been reported. The
    worker is held while the daemon runs ahead of it (W's next chunks scheduled, not executed);
    R arrives sharing W's prompt, and the worker then applies W's chunks and R's placement at
    one step boundary. W runs one chunk per step, so had R hit W's scheduled-but-unwritten
    blocks, R's first step would read cache noise there (and the cached count would exceed what
    W had reported)."""
    shared = make_prompt(400, 160)
    engine = {"scheduler.max_num_batched_tokens": 64, "scheduler.long_prefill_token_threshold": 16}

    async def go() -> tuple[Result, Result, int]:
        async with model_daemon(engine=engine) as h:
            sched, worker = h.daemon.engines["i0"].sched, h.workers["i0"]
            assert sched is not None
            step, gate, held = worker._step, asyncio.Event(), asyncio.Event()
            gate.set()
            inbox = worker._inbox
            assert inbox is not None

            async def gated_step(engine: Any, outbox: Any) -> None:
                if not gate.is_set():
                    held.set()
                    await gate.wait()
                    # Apply what arrived meanwhile at this same step boundary, as a worker that
                    # fell a step behind the daemon does: W's pending chunks and R together.
                    while not inbox.empty():
                        worker._accept(engine, inbox.get_nowait(), outbox)
                await step(engine, outbox)

            worker._step = gated_step  # type: ignore[method-assign]
            w_task = asyncio.create_task(h.generate("W", shared + make_prompt(401, 5), 10))
            await wait_until(lambda: progress(sched, "W")[1] >= 32, 10.0, "W's first chunks")
            gate.clear()
            await asyncio.wait_for(held.wait(), 10.0)
            await wait_until(
                lambda: sched.last_report_step == worker.engine.step_count, 10.0, "last report"
            )
            computed, reported = progress(sched, "W")
            assert computed > reported, "the daemon should have scheduled ahead of the worker"
            r_arrived, put = asyncio.Event(), inbox.put_nowait

            def put_and_note(item: Any) -> None:
                put(item)
                if isinstance(item, Tasks) and any(p.req_id == "R" for p in item.placements):
                    r_arrived.set()

            inbox.put_nowait = put_and_note  # type: ignore[method-assign]
            r_task = asyncio.create_task(h.generate("R", shared + make_prompt(402, 9), 10))
            await asyncio.wait_for(r_arrived.wait(), 10.0)  # R's placement reached the worker
            gate.set()
            return await w_task, await r_task, reported

    w, r, reported = run(go())
    assert_matches_reference([w, r])
    assert 0 < r.finished.usage.cached_tokens <= reported


def progress(sched: Any, req_id: str) -> tuple[int, int]:
    """(KV positions scheduled, KV positions reported written) of a live request."""
    req = sched.requests.get(req_id)
    return (req.num_computed_tokens, req.num_reported_tokens) if req else (0, 0)


# ---- (3) preemption and recompute ------------------------------------------------------------


def test_small_pool_preempts_and_recomputes_to_the_same_tokens(backend: str) -> None:
    # 24 blocks of 8 tokens: any one request fits alone, six cannot run together.
    node = Node(num_gpu_blocks=24, num_slots=8)
    engine = {"cache.prealloc_threshold": 4, "cache.prealloc_blocks": 1}
    rng = random.Random(3)
    specs = [
        (f"p{i}", make_prompt(300 + i, rng.randint(40, 90)), rng.randint(25, 40)) for i in range(6)
    ]

    async def go() -> tuple[list[Result], Any]:
        async with model_daemon({"i0": node}, backend=backend, engine=engine) as h:
            results = await generate_all(h, specs)
            await h.wait_pool_free()
            return results, await h.status("i0")

    results, st = run(go())
    assert st.num_preemptions >= 2, f"expected repeated preemption, got {st.num_preemptions}"
    assert_matches_reference(results)


# ---- (4) aborts ------------------------------------------------------------------------------


def test_random_aborts_leave_the_other_requests_exact(backend: str) -> None:
    rng = random.Random(4)
    specs = varied_requests(10, seed=4, prefix="a")
    specs = [(rid, prompt, 40) for rid, prompt, _ in specs]
    abort_after = {rid: rng.randint(0, 12) for rid, _, _ in specs[::2]}  # 0: abort once queued

    async def go() -> list[Result]:
        async with model_daemon(
            backend=backend, engine={"scheduler.max_num_batched_tokens": 64}
        ) as h:
            results = await asyncio.gather(
                *(h.generate(rid, p, m, abort_after=abort_after.get(rid)) for rid, p, m in specs)
            )
            await h.wait_pool_free()
            return list(results)

    results = run(go())
    assert_matches_reference([r for r in results if r.req_id not in abort_after])
    assert_aborted_are_prefixes([r for r in results if r.req_id in abort_after])


def assert_aborted_are_prefixes(aborted: list[Result]) -> None:
    """Aborted requests streamed a prefix of the reference; most were cut mid-decode."""
    num_mid_decode = 0
    for r in aborted:
        assert r.tokens == r.expected[: len(r.tokens)], f"{r.req_id}: not a reference prefix"
        if r.reason == ABORT:
            num_mid_decode += 0 < len(r.tokens) < r.max_tokens
        else:  # it finished before the abort arrived
            assert r.reason == LENGTH and r.tokens == r.expected
    assert num_mid_decode >= 2, [(r.req_id, len(r.tokens), r.reason) for r in aborted]


# ---- (5) prefill / decode hand-off -----------------------------------------------------------

# Both workers accept KV pushes (as a deployment would run them); only d receives any. d holds
# room for every request at once: a prefill instance refuses a request d has no room for.
PD_NODES = {
    "p": Node(role="prefill", num_gpu_blocks=96, kv_listen=True),
    "d": Node(role="decode", num_gpu_blocks=256, kv_listen=True),
}
PD_ENGINE = {"scheduler.max_num_batched_tokens": 48}


def test_prefill_decode_hand_off_matches_reference(backend: str) -> None:
    specs = varied_requests(6, seed=5, prefix="pd")
    specs.append(("pd-again", specs[0][1], 12))  # a prefix hit on p: hit blocks are pushed too

    async def go() -> tuple[list[Result], ModelHarness]:
        async with model_daemon(PD_NODES, backend=backend, engine=PD_ENGINE) as h:
            results = await generate_all(h, specs[:-1])
            results.append(await h.generate(*specs[-1]))
            await h.wait_pool_free()
            return results, h

    results, h = run(go())
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"p"}
    assert h.workers["p"].stats.num_kv_pushes == len(specs)
    assert h.workers["d"].stats.num_kv_received == len(specs)
    assert h.workers["p"].stats.num_kv_push_failures == 0
    # p computed one token per request; d decoded the rest.
    assert sum(sum(rep.num_new_tokens) for rep in h.reports["p"]) == len(specs)


def test_refused_kv_push_falls_back_to_recompute_on_the_decode_instance() -> None:
    async def go() -> tuple[Result, Result, int, int]:
        async with model_daemon(PD_NODES, engine=PD_ENGINE) as h:
            d = h.workers["d"]
            accept = d.receive_kv

            async def refuse(request: Any) -> tuple[grpc.StatusCode, str]:
                return grpc.StatusCode.FAILED_PRECONDITION, "refused by the test"

            d.receive_kv = refuse  # type: ignore[method-assign]
            recomputed = await h.generate("refused", make_prompt(500, 70), 20)
            await h.wait_pool_free()
            d.receive_kv = accept  # type: ignore[method-assign]
            ok = await h.generate("after", make_prompt(501, 50), 20)
            await h.wait_pool_free()
            p_stats = h.workers["p"].stats
            return recomputed, ok, p_stats.num_kv_push_failures, p_stats.num_kv_pushes

    recomputed, ok, num_push_failures, num_pushes = run(go())
    assert num_push_failures == 1 and num_pushes == 1
    # The decode instance prefilled the prompt and the first token itself: nothing lost.
    assert recomputed.instance == "p" and recomputed.reason == LENGTH
    assert_matches_reference([recomputed, ok])


def test_decode_worker_lost_before_push_ends_with_error_and_frees_both_pools() -> None:
    async def go() -> tuple[Result, Result]:
        async with model_daemon(PD_NODES, engine=PD_ENGINE) as h:
            p = h.workers["p"]
            push = p.kv._push

            async def stop_decode_then_push(due: Any) -> None:
                await h.stop_worker("d")  # its KV server is closed when this returns
                await push(due)

            p.kv._push = stop_decode_then_push  # type: ignore[method-assign]
            failed = await h.generate("lost", make_prompt(510, 60), 20)
            p.kv._push = push  # type: ignore[method-assign]
            assert (await h.status("p")).num_free_blocks == PD_NODES["p"].num_gpu_blocks
            h.start_worker("d")
            await h.wait_ready(["d"])
            await h.wait_pool_free()
            ok = await h.generate("after", make_prompt(511, 50), 20)
            await h.wait_pool_free()
            return failed, ok

    failed, ok = run(go())
    assert failed.reason == ERROR, failed.finished
    # At most the prompt's first token (the prefill side computed it), never a wrong one.
    assert len(failed.tokens) <= 1 and failed.tokens == failed.expected[: len(failed.tokens)]
    assert "KV transfer" in failed.finished.message, failed.finished
    assert_matches_reference([ok])


def test_aborts_before_and_after_hand_off_free_both_pools() -> None:
    """Abort while p prefills (the decode reservation is cancelled) or while d decodes."""
    specs = [(rid, prompt, 30) for rid, prompt, _ in varied_requests(8, seed=8, prefix="pda")]
    abort_after = {"pda0": 0, "pda2": 0, "pda4": 2, "pda6": 5, "pda7": 9}

    async def go() -> list[Result]:
        async with model_daemon(PD_NODES, engine=PD_ENGINE) as h:
            results = await asyncio.gather(
                *(h.generate(rid, p, m, abort_after=abort_after.get(rid)) for rid, p, m in specs)
            )
            await h.wait_pool_free()
            return list(results)

    results = run(go())
    assert_matches_reference([r for r in results if r.req_id not in abort_after])
    assert_aborted_are_prefixes([r for r in results if r.req_id in abort_after])


# ---- (6) two instances -----------------------------------------------------------------------


def test_two_instances_match_reference(backend: str) -> None:
    nodes = {"i0": Node(num_gpu_blocks=96), "i1": Node(num_gpu_blocks=96)}
    engine = {"scheduler.max_num_batched_tokens": 64}

    async def go() -> list[Result]:
        async with model_daemon(nodes, backend=backend, engine=engine) as h:
            results = await generate_all(h, varied_requests(10, seed=6))
            await h.wait_pool_free()
            return results

    results = run(go())
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"i0", "i1"}


# ---- (7) speculative decoding ----------------------------------------------------------------

SPEC_K = 3


def predicted_acceptance(prompt: list[int], max_tokens: int) -> list[int]:
    """Tokens per decode step the worker's n-gram draft would get accepted, if the paged run
    equals the reference (greedy verification accepts a draft iff it is the reference token)."""
    ref = reference(prompt, max_tokens)
    history, i, steps = [*prompt, ref[0]], 1, []
    while i < max_tokens:
        drafts = ngram_draft(history, min(SPEC_K, max_tokens - i - 1))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == ref[i + accepted]:
            accepted += 1
        steps.append(accepted + 1)
        history += ref[i : i + accepted + 1]
        i += accepted + 1
    return steps


def spec_prompts(max_tokens: int) -> list[list[int]]:
    """Prompts repeating a short pattern whose greedy continuation the n-gram draft sometimes
    predicts: together their decode steps accept every number of drafts from 0 to SPEC_K."""
    found: list[list[int]] = []
    seen: set[int] = set()
    for seed in range(400):
        rng = random.Random(seed)
        pattern = make_prompt(700 + seed, rng.choice([1, 2, 3, 4, 6, 8]))
        prompt = (pattern * 100)[: rng.randint(30, 90)]
        steps = predicted_acceptance(prompt, max_tokens)
        if max(steps) > 1:
            found.append(prompt)
            seen.update(steps)
            if seen >= set(range(1, SPEC_K + 2)) and len(found) >= 4:
                return found
    raise AssertionError(f"no prompts found whose drafts are accepted 0..{SPEC_K} at a time")


def test_speculative_decoding_with_ngram_drafts_matches_reference(backend: str) -> None:
    max_tokens = 40
    specs = [(f"spec{i}", p, max_tokens) for i, p in enumerate(spec_prompts(max_tokens))]
    specs += varied_requests(3, seed=7, prefix="plain")  # drafts mostly rejected
    engine = {"speculative.num_speculative_tokens": SPEC_K, "scheduler.max_num_batched_tokens": 64}

    async def go() -> tuple[list[Result], ModelHarness, Any, str]:
        async with model_daemon(backend=backend, engine=engine) as h:
            results = await generate_all(h, specs)
            await h.wait_pool_free()
            sched = h.daemon.engines["i0"].sched
            assert sched is not None
            metrics = generate_latest(h.daemon.telemetry.metrics.registry).decode()
            return results, h, sched.snapshot(), metrics

    results, h, snap, metrics = run(go())
    assert_matches_reference(results)
    per_row = [n for rep in h.reports["i0"] for n in rep.num_new_tokens if n]
    # 1 + accepted drafts per decode step: every count from none to all SPEC_K drafts occurs
    assert set(range(1, SPEC_K + 2)) <= set(per_row), sorted(per_row)
    # Each drafted row's drafts and accepted drafts reach the daemon (over the wire), which
    # counts them per instance and per request (the acceptance-rate histogram, one per request).
    reps = h.reports["i0"]
    drafts = sum(d for rep in reps for d in rep.num_draft_tokens)
    accepted = sum(a for rep in reps for a in rep.num_accepted_drafts)
    assert 0 < accepted < drafts
    assert (snap.num_draft_tokens, snap.num_accepted_drafts) == (drafts, accepted)
    total = re.search(
        r'kvsched_spec_decode_num_draft_tokens_total\{instance="i0"[^}]*\} (\S+)', metrics
    )
    assert total is not None and float(total.group(1)) == drafts
    count = re.search(r"kvsched_request_spec_decode_acceptance_rate_count\{[^}]*\} (\S+)", metrics)
    drafted = {rid for rep in reps for rid in rep.draft_handles}
    assert count is not None and float(count.group(1)) == len(drafted) > 0


# ---- (8) the check can fail ------------------------------------------------------------------


def test_corrupted_block_table_is_detected() -> None:
    """Hand one of A's blocks to B as well (ref counted, so the pool stays consistent): B's
    prefill overwrites A's K/V there and A's tokens leave the reference."""

    async def go() -> tuple[Result, Result]:
        async with model_daemon() as h:
            sched = h.daemon.engines["i0"].sched
            assert sched is not None
            kv, allocate = sched.kv, sched.kv.allocate_slots
            corrupted: list[int] = []

            def corrupt(req: Request, num_tokens: int, hits: list[int] | None = None) -> Any:
                new = allocate(req, num_tokens, hits)
                if req.req_id == "B" and new and not corrupted:
                    victim = sched.requests["A"].block_ids[0]
                    kv.pool.free([new[0]])
                    kv.pool.touch([victim])
                    req.block_ids[req.block_ids.index(new[0])] = victim
                    new[0] = victim
                    corrupted.append(victim)
                return new

            kv.allocate_slots = corrupt  # type: ignore[method-assign]
            a = asyncio.create_task(h.generate("A", make_prompt(800, 60), 40))
            await wait_until(
                lambda: (
                    "A" in h.daemon.tracked and len(h.daemon.tracked["A"].req.output_token_ids) >= 1
                ),
                10.0,
                "A's first token",
            )
            b = await h.generate("B", make_prompt(801, 60), 20)
            return await a, b

    a, b = run(go())
    assert a.reason == b.reason == LENGTH
    assert a.tokens != a.expected, "a block shared by two requests went unnoticed"
    assert b.tokens == b.expected  # B wrote the shared block last: only A reads wrong K/V


# ---- (9) real processes ----------------------------------------------------------------------


def test_real_serve_and_model_worker_processes_match_reference() -> None:
    env = {"KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": "48"}
    daemon, address = procs.start_daemon(env=env)
    worker = None
    try:
        worker = procs.start_worker(
            address,
            "i0",
            *("--executor", "model", "--backend", "numpy", "--num-blocks", "128"),
            *("--block-size", "8", "--num-slots", "8"),
        )
        procs.wait_ready(address, ["i0"])
        specs = varied_requests(4, seed=9, prefix="proc")
        with grpc.insecure_channel(address) as channel:
            stub = request_service_pb2_grpc.RequestServiceStub(channel)
            calls = [stub.Generate(generate_request(*s), timeout=30) for s in specs]
            results = [collect(s, call) for s, call in zip(specs, calls, strict=True)]
        procs.wait_pool_free(address)
        assert_matches_reference(results)
    finally:
        if worker is not None:
            worker.stop()
        daemon.stop()


def collect(spec: tuple[str, list[int], int], call: Any) -> Result:
    out = Result(*spec)
    for r in call:
        kind = r.WhichOneof("kind")
        if kind == "tokens":
            out.tokens.extend(r.tokens.token_ids)
        elif kind == "finished":
            out.finished = r.finished
        elif kind == "queued":
            out.instance = r.queued.instance
    return out
