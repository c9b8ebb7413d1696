"""The storage tier (Mooncake Store) with a vLLM worker: blocks vLLM computed are written to a
real store when the small KV pool evicts them (their bytes read out of vLLM's cache), and a
later prompt with the same prefix fetches them back into fresh blocks of vLLM's cache instead
of recomputing them; the texts must be exactly vLLM's own `LLM.generate` (greedy, same tiny
model). Real processes on loopback: `kvsched serve --storage`, `kvsched worker --executor
vllm`, a Mooncake master and segment holder.

Needs vLLM (`make test-vllm`) and the storage extra; skipped without them.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.client import AsyncClient
from kvsched.storage import mooncake_available
from kvsched.storage.server import MooncakeServer
from kvsched.tinymodel.model import make_model
from tests.integration.harness import start_daemon, status, wait_pool_free, wait_ready
from tests.vllm.vllm_kit import reference_outputs, vllm_worker

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not mooncake_available(), reason="the storage extra is not installed"),
]

BS = 32  # vLLM's block size on CPU
NUM_BLOCKS = 16  # 512 tokens: three 300-token prompts evict every block of the prefix
PREFIX_BLOCKS = 4


def storage_requests() -> list[dict[str, Any]]:
    rng = random.Random(3)
    prefix = [rng.randrange(5, 512) for _ in range(PREFIX_BLOCKS * BS)]
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}

    def req(rid: str, prompt: list[int]) -> dict[str, Any]:
        return {"id": rid, "prompt": prompt, "params": dict(greedy)}

    reqs = [req("first", prefix + [rng.randrange(5, 512) for _ in range(20)])]
    reqs += [req(f"fill{k}", [rng.randrange(5, 512) for _ in range(300)]) for k in range(3)]
    reqs += [
        req(f"again{k}", prefix + [rng.randrange(5, 512) for _ in range(9 + k)]) for k in range(3)
    ]
    return reqs


async def run_in_order(address: str, reqs: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    async with AsyncClient(address, timeout=600) as client:
        for r in reqs:  # one at a time: the fillers evict the prefix before it is asked again
            stream = await client.generate(r["prompt"], request_id=r["id"], **r["params"])
            tokens: list[int] = []
            async for batch in stream:
                tokens.extend(batch)
            assert stream.finished is not None and stream.finished.reason == "length", r["id"]
            out[r["id"]] = tokens
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.mark.parametrize(
    ("host_blocks", "prefetch"),
    [(0, False), (8, False), (16, True)],
    ids=["from-gpu", "from-host-tier", "prefetched-to-host"],
)
def test_storage_hits_are_fetched_into_vllms_cache(
    model: Path, tmp_path: Path, host_blocks: int, prefetch: bool
) -> None:
    """host_blocks 0: an evicted GPU block is written from vLLM's cache; 8: evicted GPU blocks
    go to the host tier first and are written from there when it evicts them in turn;
    prefetch: a request's storage hits come into the host tier before its placement
    (`storage_prefetch_at_arrival`, held until they land: kv_transfer.import_host) and are
    swapped in from there, none fetched on a step."""
    reqs = storage_requests()
    pf_env = {
        "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH": "true",
        "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH_AT_ARRIVAL": "true",
        "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH_HOLD_MS": "60000",
    }
    with MooncakeServer(capacity_bytes=64 << 20) as store:
        daemon, address = start_daemon(
            "--storage",
            store.url,
            env={
                "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": "128",
                "KVSCHED_ENGINE__SCHEDULER__MIN_PREFILL_CHUNK": "32",
                "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
                # The tiny model recomputes 128 tokens in about what the seed prices 4 fetches
                # at (0.1 ms each: a 2 MiB block over RDMA): seed it at the tiny block's cost,
                # so the step-cost model fetches (it learns the real cost from that fetch on).
                "KVSCHED_ENGINE__STEP_COST__PER_FETCHED_BLOCK_MS": "0.0001",
                **(pf_env if prefetch else {}),
            },
        )
        # (vLLM refuses a max_model_len its blocks cannot hold)
        worker = vllm_worker(
            address,
            "v0",
            model,
            NUM_BLOCKS,
            "--max-model-len",
            "512",
            "--host-blocks",
            str(host_blocks),
        )
        try:
            wait_ready(address, ["v0"], timeout=300)
            got = asyncio.run(run_in_order(address, reqs))
            wait_pool_free(address, timeout=30)
            st = status(address).instances[0]
        finally:
            worker.stop()
            daemon.stop()
            print("\n--- worker output (tail) ---\n" + "\n".join(worker.lines[-15:]))
    ref = reference_outputs(model, reqs, tmp_path)
    bad = [
        f"{r['id']}: kvsched {got[r['id']]} vLLM {want}"
        for r, want in zip(reqs, ref, strict=True)
        if got[r["id"]] != want
    ]
    print(
        f"\nstorage tier ({host_blocks} host blocks): {len(reqs) - len(bad)}/{len(reqs)} equal to vLLM; blocks written "
        f"{st.num_storage_writes}, fetched {st.num_storage_fetches}, failures "
        f"{st.num_storage_failures}; storage hit tokens {st.prefix_cache_storage_hit_tokens} "
        f"({st.prefix_cache_prefetched_hit_tokens} prefetched) "
        f"(prefix hits {st.prefix_cache_hit_tokens} of {st.prefix_cache_query_tokens})"
    )
    assert not bad, "\n".join(bad)
    assert st.num_storage_failures == 0
    assert st.num_storage_writes >= PREFIX_BLOCKS, "the evicted prefix was not written"
    # Each `again` request found the prefix in the store (none of it left in the pool).
    assert st.prefix_cache_storage_hit_tokens >= PREFIX_BLOCKS * BS, st
    if prefetch:  # brought to the host tier before placement, swapped in: never fetched
        assert st.prefix_cache_prefetched_hit_tokens == st.prefix_cache_storage_hit_tokens, st
        assert st.num_storage_fetches == 0 and st.num_storage_prefetches >= PREFIX_BLOCKS, st
    else:
        assert st.num_storage_fetches >= PREFIX_BLOCKS
