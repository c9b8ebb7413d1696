"""LoRA adapters under vLLM's model runner: a vLLM worker started with three adapters
(`--lora-modules`, made offline in PEFT's format from the tiny model) and `--max-loras 2` runs
30 interleaved greedy requests across the three adapters and the base model, some naming their
adapter by `lora_name`, some by `model` (as vLLM's server takes it), half sharing one prompt
prefix (the prefix cache is keyed by adapter: a block computed under one adapter must never
serve another). Every adapter text must equal vLLM's own `LLM.generate` with the same
LoRARequests (vLLM's CPU LoRA kernels run a base request batched with adapter requests with the
last adapter slot's weights: the worker masks those rows, `kvsched/worker_vllm/lora.py`, and the
reference runs base requests in a generate call of their own), and the worker's count of every step it ran must never show more than 2 distinct adapters (while
the limit binds: steps with 2 happen). Real processes on loopback.

Needs vLLM (`make test-vllm`); skipped in the main virtualenv.
"""

from __future__ import annotations

import ast
import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this")

from kvsched.client import AsyncClient
from kvsched.tinymodel.lora import make_adapter
from kvsched.tinymodel.model import make_model
from tests.integration.harness import start_daemon, status, wait_pool_free, wait_ready
from tests.vllm.test_pd import compare
from tests.vllm.vllm_kit import reference_outputs, vllm_worker

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_LORAS = 2
RANK = 8
CONCURRENCY = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        f"ad{i}": str(make_adapter(model, root / f"ad{i}", seed=i, rank=RANK)) for i in (1, 2, 3)
    }


def lora_requests(n: int, names: list[str]) -> list[dict[str, Any]]:
    """n greedy requests, adapters interleaved (and the base model), half sharing a prefix."""
    rng = random.Random(36)
    prefix = [rng.randrange(5, 512) for _ in range(64)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(5, 512) for _ in range(rng.randrange(4, 60))]
        prompt = prefix + tail if i % 2 == 0 else tail
        lora = [*names, ""][i % (len(names) + 1)]
        params = {"max_tokens": rng.choice([16, 24, 32]), "temperature": 0.0, "ignore_eos": True}
        reqs.append({"id": f"lo{i}", "prompt": prompt, "params": params, "lora": lora})
    return reqs


async def run_all(address: str, reqs: list[dict[str, Any]]) -> dict[str, tuple[list[int], str]]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(client: AsyncClient, i: int, r: dict[str, Any]) -> tuple[list[int], str]:
        # Every other adapter request names its adapter as the model, as vLLM's server takes it.
        name = {"model": r["lora"]} if r["lora"] and i % 4 == 0 else {"lora_name": r["lora"]}
        async with gate:
            stream = await client.generate(r["prompt"], request_id=r["id"], **name, **r["params"])
            tokens: list[int] = []
            async for batch in stream:
                tokens.extend(batch)
            assert stream.finished is not None
            return tokens, stream.finished.reason + ":" + stream.finished.message

    async with AsyncClient(address, timeout=600) as client:
        done = await asyncio.gather(*(one(client, i, r) for i, r in enumerate(reqs)))
    return {r["id"]: d for r, d in zip(reqs, done, strict=True)}


def test_three_adapters_with_max_loras_2_give_vllms_tokens(
    model: Path, adapters: dict[str, str], tmp_path: Path
) -> None:
    reqs = lora_requests(30, list(adapters))
    daemon, address = start_daemon(
        env={
            "KVSCHED_ENGINE__SCHEDULER__MAX_NUM_BATCHED_TOKENS": "256",
            "KVSCHED_ENGINE__SCHEDULER__MAX_MODEL_LEN": "1024",
        }
    )
    modules = [f"{n}={p}" for n, p in adapters.items()]
    worker = vllm_worker(
        address,
        "v0",
        model,
        256,
        "--lora-modules",
        *modules,
        "--max-loras",
        str(MAX_LORAS),
        "--max-lora-rank",
        str(RANK),
    )
    try:
        wait_ready(address, ["v0"], timeout=300)
        got = asyncio.run(run_all(address, reqs))
        st = status(address).instances[0]
        wait_pool_free(address, timeout=30)  # every block returned
    finally:
        worker.stop()
        daemon.stop()
        print("\n--- worker output (tail) ---\n" + "\n".join(worker.lines[-4:]))
    # vLLM's own generate with the same LoRARequests, its base requests in a generate call of
    # their own (vLLM's CPU kernels give a base request batched with adapter requests the last
    # adapter slot's weights: worker_vllm/lora.py, mask_base_rows; reference.py).
    lora = {"modules": adapters, "max_loras": MAX_LORAS, "max_lora_rank": RANK}
    # (One process: the same requests without their adapters too, to show adapters matter.)
    both = reference_outputs(model, reqs + [dict(r, lora="") for r in reqs], tmp_path, lora=lora)
    ref, base = both[: len(reqs)], both[len(reqs) :]
    bad = compare(reqs, got, ref)
    m = worker.wait_for(r"LoRA steps by adapters (\{[^}]*\}) \((\d+) over max_loras (\d+)\)")
    by_count: dict[int, int] = ast.literal_eval(m.group(1))
    over, limit = int(m.group(2)), int(m.group(3))
    differs = sum(1 for r, a, b in zip(reqs, ref, base, strict=True) if r["lora"] and a != b)
    print(
        f"\nLoRA: {len(reqs) - len(bad)}/{len(reqs)} equal to vLLM with the same adapters; "
        f"{differs}/{sum(1 for r in reqs if r['lora'])} adapter texts differ from the base "
        f"model's; worker steps by distinct adapters {by_count}, {over} over max_loras "
        f"{limit}; {st.num_steps} daemon steps, prefix hits {st.prefix_cache_hit_tokens} of "
        f"{st.prefix_cache_query_tokens} tokens"
    )
    assert not bad, "\n".join(bad)
    assert limit == MAX_LORAS and over == 0
    assert max(by_count) <= MAX_LORAS, f"a step ran more than {MAX_LORAS} adapters"
    assert MAX_LORAS in by_count, "the limit never bound: no step ran 2 adapters"
    assert differs == sum(1 for r in reqs if r["lora"]), "an adapter changed nothing"
    assert st.prefix_cache_hit_tokens > 0, "no prefix hit (within one adapter)"
