"""Prefill/decode hand-off through the shared storage tier (`cache.pd_transfer = "storage"`,
issue 36) with the `model` executor and a real Mooncake Store: the prefill instance computes
each prompt and its first token, its worker writes the prompt's full blocks to the store, and
the decode instance fetches them into its own blocks and decodes on. No KV push at all. Every
streamed token is checked against `generate_reference`, so a fetch of the wrong key, into the
wrong block, or after the chunk that reads it changes tokens. A hand-off whose writes or
fetches fail recomputes on the decode instance: tokens still equal, every block freed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvsched.storage.server import MooncakeServer
from tests.e2e.harness import (
    ModelHarness,
    Node,
    Result,
    generate_request,
    make_prompt,
    model_daemon,
    run,
)
from tests.e2e.test_model_worker import (
    assert_aborted_are_prefixes,
    assert_matches_reference,
    generate_all,
    varied_requests,
)
from tests.storage.conftest import mooncake  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

BS = 8  # the harness's block size
NODES = {"p": Node(role="prefill", num_gpu_blocks=96), "d": Node(role="decode", num_gpu_blocks=256)}
ENGINE = {"scheduler.max_num_batched_tokens": 48, "cache.pd_transfer": "storage"}


def _specs(seed: int) -> list[tuple[str, list[int], int]]:
    specs = varied_requests(6, seed=seed, prefix=f"ps{seed}-")
    specs.append((f"ps{seed}-again", specs[0][1], 12))  # its blocks are stored already
    return specs


async def _serve(h: ModelHarness, specs: list[tuple[str, list[int], int]]) -> list[Result]:
    results = await generate_all(h, specs[:-1])
    results.append(await h.generate(*specs[-1]))
    await h.wait_pool_free()  # every block of both instances returned
    return results


def _keys(h: ModelHarness, iid: str, field: str) -> list[str]:
    return [k for t in h.applied[iid] for k in getattr(t, field)]


def test_hand_off_through_the_store_matches_reference(mooncake: MooncakeServer) -> None:  # noqa: F811
    specs = _specs(11)

    async def go() -> tuple[list[Result], ModelHarness, Any, Any]:
        async with model_daemon(NODES, engine=ENGINE, settings={"storage": mooncake.url}) as h:
            results = await _serve(h, specs)
            return results, h, await h.status("p"), await h.status("d")

    results, h, st_p, st_d = run(go())
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"p"}
    # No push: the prompt's full blocks went through the store, written by p, fetched by d.
    assert h.workers["p"].stats.num_kv_pushes == 0
    assert h.workers["d"].stats.num_kv_received == 0
    written, fetched = _keys(h, "p", "storage_write_keys"), _keys(h, "d", "storage_fetch_keys")
    assert set(fetched) <= set(written) and len(set(written)) == len(written)
    # Every full prompt block fetched once; the repeated prompt's were still in d's cache.
    want = sum(len(prompt) // BS for _, prompt, _ in specs[:-1])
    assert len(fetched) == want, (len(fetched), want)
    assert st_d.prefix_cache_storage_hit_tokens == want * BS
    assert st_d.prefix_cache_hit_tokens == (want + len(specs[-1][1]) // BS) * BS
    assert st_p.num_storage_failures == 0 and st_d.num_storage_failures == 0
    # p computed one token per request; d decoded the rest.
    assert sum(sum(rep.num_new_tokens) for rep in h.reports["p"]) == len(specs)


def _failing(what: str) -> Any:
    """Patch every executor so its storage reads (writes to the store) or its storage writes
    (fetches from the store into GPU blocks) raise."""
    name = "storage_read" if what == "write" else "storage_write"

    def patch(executor: Any) -> None:
        def fail(*args: Any) -> Any:
            raise OSError(f"storage {what} failed by the test")

        setattr(executor, name, fail)

    return patch


@pytest.mark.parametrize("what", ["write", "fetch"])
def test_failed_store_hand_off_recomputes_on_the_decode_instance(
    mooncake: MooncakeServer,  # noqa: F811
    what: str,
) -> None:
    """Writes fail (nothing stored: d finds no hit and recomputes the prompt) or fetches fail
    (d's fetch is reported failed: it is preempted and recomputes): tokens equal, no loss."""
    specs = [
        (f"pf{what}{i}", make_prompt(3100 + 10 * i + len(what), 40 + 30 * i), 10) for i in range(3)
    ]

    async def go() -> tuple[list[Result], ModelHarness, Any]:
        async with model_daemon(
            NODES,
            engine=ENGINE,
            settings={"storage": mooncake.url},
            patch_executor=_failing(what),
        ) as h:
            results = await generate_all(h, specs)
            await h.wait_pool_free()
            return results, h, await h.status("d")

    results, h, st_d = run(go())
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"p"}
    failed_fetches = [f for rep in h.reports["d"] for f in rep.failed_storage_fetches]
    if what == "write":
        assert any(rep.failed_storage_writes for rep in h.reports["p"])
        assert not _keys(h, "d", "storage_fetch_keys") and not failed_fetches
    else:
        assert failed_fetches and st_d.num_preemptions >= len(failed_fetches)
    # d prefilled each prompt itself (its lookups count every prompt and first token).
    assert st_d.prefix_cache_query_tokens >= sum(len(p) + 1 for _, p, _ in specs)


def test_aborts_while_prefilling_storing_and_decoding_free_both_pools(
    mooncake: MooncakeServer,  # noqa: F811
) -> None:
    """Abort before the first token (on p), right after it (p's writes in flight or the
    request queued on d) and while d decodes: each ends once, as a prefix of the reference;
    the others are unaffected; every block of both instances is free."""
    specs = [(rid, prompt, 30) for rid, prompt, _ in varied_requests(10, seed=12, prefix="pa")]
    abort_after = {"pa0": 0, "pa1": 1, "pa3": 1, "pa5": 1, "pa6": 2, "pa8": 6}

    async def go() -> list[Result]:
        async with model_daemon(NODES, engine=ENGINE, settings={"storage": mooncake.url}) as h:
            results = await asyncio.gather(
                *(h.generate(rid, p, m, abort_after=abort_after.get(rid)) for rid, p, m in specs)
            )
            await h.wait_pool_free()
            return list(results)

    results = run(go())
    assert_matches_reference([r for r in results if r.req_id not in abort_after])
    assert_aborted_are_prefixes([r for r in results if r.req_id in abort_after])


def test_a_client_may_not_claim_a_prefilled_hand_off(mooncake: MooncakeServer) -> None:  # noqa: F811
    """prefilled_token_ids / stored_prompt_blocks come only from a peer daemon's forward: a
    client's is INVALID_ARGUMENT naming them, and nothing is queued."""

    async def go() -> tuple[grpc.StatusCode, str, Any]:
        async with model_daemon(NODES, engine=ENGINE, settings={"storage": mooncake.url}) as h:
            msg = generate_request("claim", make_prompt(3300, 40), 4)
            msg.prefilled_token_ids.extend([5])
            msg.stored_prompt_blocks = 5
            try:
                async for _ in h.stub.Generate(msg, timeout=10):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or "", await h.status("d")
            raise AssertionError("accepted")

    code, details, st = run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prefilled_token_ids" in details
    assert st.num_waiting == 0 and st.num_running == 0
