"""Prefill/decode hand-off with vLLM workers: a prefill instance's vLLM worker computes each
prompt (chunked, with prefix hits) and pushes its KV blocks, read out of vLLM's cache, to the
decode instance's vLLM worker, which writes them into its cache and continues from them; the
texts must be exactly vLLM's own `LLM.generate` (greedy, same tiny model). Real processes on
loopback: one daemon, two `kvsched worker --executor vllm --listen-kv`.

Needs vLLM (`make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.client import AsyncClient
from kvsched.tinymodel.model import make_model
from tests.integration.harness import status, wait_pool_free, wait_ready
from tests.vllm.vllm_kit import daemon_with_config, reference_outputs, vllm_worker, worker_kv_counts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PD_TOML = """
[engine.scheduler]
max_num_batched_tokens = 128
min_prefill_chunk = 32
max_model_len = 1024

[instances.p]
role = "prefill"

[instances.d]
role = "decode"
"""
CONCURRENCY = 6  # requests in flight: the decode instance has room for all their reservations


def pd_requests(n: int, seed: int) -> list[dict[str, Any]]:
    """n greedy requests: half share one of two 64-token prefixes (prefix hits on the prefill
    side: hit blocks are pushed too), some longer than a step's budget (chunked prefill)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 512) for _ in range(64)] for _ in range(2)]
    reqs = []
    for i in range(n):
        if i % 2 == 0:
            prompt = prefixes[i % 4 // 2] + [
                rng.randrange(5, 512) for _ in range(rng.randrange(3, 40))
            ]
        else:
            prompt = [rng.randrange(5, 512) for _ in range(rng.randrange(5, 300))]
        params: dict[str, Any] = {"max_tokens": rng.choice([16, 24, 40]), "temperature": 0.0}
        if i % 3 == 0:
            params["ignore_eos"] = True
        reqs.append({"id": f"pd{seed}-{i}", "prompt": prompt, "params": params})
    return reqs


async def run_all(address: str, reqs: list[dict[str, Any]]) -> dict[str, tuple[list[int], str]]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: AsyncClient, r: dict[str, Any]) -> tuple[list[int], str]:
        async with gate:
            stream = await client.generate(r["prompt"], request_id=r["id"], **r["params"])
            tokens: list[int] = []
            async for batch in stream:
                tokens.extend(batch)
            assert stream.finished is not None
            return tokens, stream.finished.reason + ":" + stream.finished.message

    async with AsyncClient(address, timeout=600) as client:
        done = await asyncio.gather(*(one(client, r) for r in reqs))
    return {r["id"]: d for r, d in zip(reqs, done, strict=True)}


def compare(reqs: list[dict[str, Any]], got: dict[str, Any], ref: list[list[int]]) -> list[str]:
    bad = []
    for r, want in zip(reqs, ref, strict=True):
        have, reason = got[r["id"]]
        if have != want or not reason.startswith(("stop", "length")):
            bad.append(f"{r['id']}: {reason} kvsched {have} vLLM {want}")
    return bad


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_prefill_decode_hand_off_gives_vllm_tokens(model: Path, tmp_path: Path) -> None:
    reqs = pd_requests(20, seed=1)
    daemon, address = daemon_with_config(PD_TOML, tmp_path)
    kv = ("--listen-kv", "127.0.0.1:0")
    p = vllm_worker(address, "p", model, 64, *kv)
    d = vllm_worker(address, "d", model, 256, *kv)
    try:
        wait_ready(address, ["p", "d"], timeout=300)
        got = asyncio.run(run_all(address, reqs))
        st = {i.instance_id: i for i in status(address).instances}
        wait_pool_free(address, timeout=30)  # every block returned, on both instances
    finally:
        p.stop()
        d.stop()
        daemon.stop()
    ref = reference_outputs(model, reqs, tmp_path)
    bad = compare(reqs, got, ref)
    pushes, push_failures, _ = worker_kv_counts(p)
    _, _, received = worker_kv_counts(d)
    print(
        f"\nP/D: {len(reqs) - len(bad)}/{len(reqs)} equal to vLLM; pushes {pushes} "
        f"(failed {push_failures}), received {received}; prefix hits on p "
        f"{st['p'].prefix_cache_hit_tokens} of {st['p'].prefix_cache_query_tokens} tokens"
    )
    assert not bad, "\n".join(bad)
    assert pushes == received == len(reqs) and push_failures == 0
    assert st["p"].prefix_cache_hit_tokens >= 64, "no prefix hit on the prefill side"
    assert any(len(r["prompt"]) > 2 * 128 for r in reqs), "no chunked prefill"


def test_failed_hand_off_recomputes_on_the_decode_instance(model: Path, tmp_path: Path) -> None:
    """The decode worker accepts no KV pushes (started without --listen-kv: the daemon has no
    KV address for it), so every hand-off fails on the prefill side: the decode instance
    prefills each prompt and its first token itself, and the texts are still vLLM's."""
    reqs = pd_requests(8, seed=2)
    daemon, address = daemon_with_config(PD_TOML, tmp_path)
    p = vllm_worker(address, "p", model, 64, "--listen-kv", "127.0.0.1:0")
    d = vllm_worker(address, "d", model, 256)
    try:
        wait_ready(address, ["p", "d"], timeout=300)
        got = asyncio.run(run_all(address, reqs))
        st = {i.instance_id: i for i in status(address).instances}
        wait_pool_free(address, timeout=30)
    finally:
        p.stop()
        d.stop()
        daemon.stop()
    ref = reference_outputs(model, reqs, tmp_path)
    bad = compare(reqs, got, ref)
    pushes, _, _ = worker_kv_counts(p)
    _, _, received = worker_kv_counts(d)
    prompt_tokens = sum(len(r["prompt"]) for r in reqs)
    print(
        f"\nfailed hand-offs: {len(reqs) - len(bad)}/{len(reqs)} equal to vLLM; pushes {pushes}, "
        f"received {received}; prompt tokens looked up on d {st['d'].prefix_cache_query_tokens}"
    )
    assert not bad, "\n".join(bad)
    assert pushes == received == 0
    # d prefilled every prompt + first token (its lookups count them), p every prompt too.
    assert st["d"].prefix_cache_query_tokens >= prompt_tokens + len(reqs)
    assert st["p"].prefix_cache_query_tokens >= prompt_tokens
