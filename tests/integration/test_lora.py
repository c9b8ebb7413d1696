"""LoRA adapters end to end with sim workers (real daemon, real worker processes, loopback): a
worker announces its adapters and max_loras in its Hello; ListModels lists each adapter with
its base model; a request names an adapter by lora_name or by model (as vLLM's server takes
it) and runs only where the adapter is; an unknown adapter is NOT_FOUND naming it; the worker
never runs more than max_loras distinct adapters in one step (its own count of every step);
the daemon's /metrics shows vLLM's lora_requests_info."""

from __future__ import annotations

import ast
import asyncio
import random
import re
import urllib.request

import pytest

from kvsched.client import AsyncClient, Client, InvalidArgument, ModelInfo, NotFound
from tests.integration.harness import start_daemon, start_worker, wait_pool_free, wait_ready

pytestmark = pytest.mark.timeout(120)

ADAPTERS = {"sql": "/adapters/sql", "chat": "/adapters/chat", "code": "/adapters/code"}


@pytest.fixture(scope="module")
def lora_daemon():
    daemon, address = start_daemon("--metrics-listen", "127.0.0.1:0")
    metrics = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
    modules = [f"{n}={p}" for n, p in ADAPTERS.items()]
    lora = start_worker(
        address,
        "l0",
        "--served-model-name",
        "tiny",
        "--num-slots",
        "8",
        "--lora-modules",
        *modules,
        "--max-loras",
        "2",
    )
    plain = start_worker(address, "p0", "--zero-cost", "--served-model-name", "tiny")
    try:
        wait_ready(address, ["l0", "p0"])
        yield address, metrics, lora
    finally:
        plain.stop()
        lora.stop()
        daemon.stop()


def test_list_models_shows_each_adapter_with_its_base_model(lora_daemon) -> None:
    address, _, _ = lora_daemon
    with Client(address, timeout=30) as client:
        models = {m.name: m for m in client.list_models()}
    assert models["tiny"] == ModelInfo("tiny", 131072, 32000, 2)
    for name, path in ADAPTERS.items():
        assert models[name] == ModelInfo(name, 131072, 32000, 1, parent="tiny", root=path)


def test_an_adapter_named_by_lora_name_or_model_runs_where_it_is_loaded(lora_daemon) -> None:
    address, _, _ = lora_daemon
    with Client(address, timeout=30) as client:
        for i in range(4):  # (the plain instance p0 is idle: the router would pick it)
            by_name = client.generate([5 + i, 6, 7], max_tokens=3, lora_name="sql")
            by_model = client.generate([5 + i, 6, 7], max_tokens=3, model="chat")
            both = client.generate([5 + i, 6], max_tokens=3, model="tiny", lora_name="code")
            for result in (by_name, by_model, both):
                assert result.instance == "l0"
                assert len(result.tokens()) == 3
                assert result.finished is not None and result.finished.reason == "length"


def test_an_unknown_adapter_is_not_found_naming_it_and_the_known_ones(lora_daemon) -> None:
    address, _, _ = lora_daemon
    with Client(address, timeout=30) as client:
        with pytest.raises(NotFound) as e:
            client.generate([1, 2, 3], max_tokens=2, lora_name="poetry")
        assert "lora_name='poetry'" in e.value.message
        assert all(repr(n) in e.value.message for n in ADAPTERS)
        with pytest.raises(NotFound):  # an unknown model is still a model
            client.generate([1, 2, 3], max_tokens=2, model="poetry")
        with pytest.raises(NotFound) as e3:  # the same unknown name as model and lora_name
            client.generate([1, 2, 3], max_tokens=2, model="poetry", lora_name="poetry")
        assert "unknown model 'poetry'" in e3.value.message  # (was INTERNAL: a KeyError)
        with pytest.raises(InvalidArgument) as e2:  # two different adapters named
            client.generate([1, 2, 3], max_tokens=2, model="sql", lora_name="chat")
        assert "'sql'" in e2.value.message and "'chat'" in e2.value.message


def _lora_info(metrics: str) -> list[dict[str, str]]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    rows = []
    for line in text.splitlines():
        if line.startswith("kvsched_lora_requests_info{"):
            labels = line[line.index("{") + 1 : line.rindex("}")]
            rows.append(dict(re.findall(r'(\w+)="([^"]*)"', labels)))
    return rows


def test_interleaved_adapters_never_run_more_than_max_loras_in_a_step(lora_daemon) -> None:
    address, metrics, worker = lora_daemon
    rng = random.Random(7)
    names = [*ADAPTERS, ""]
    reqs = [
        ([rng.randrange(5, 500) for _ in range(rng.randrange(8, 80))], rng.choice(names))
        for _ in range(30)
    ]
    seen_running: set[str] = set()

    async def one(client: AsyncClient, prompt: list[int], lora: str) -> int:
        stream = await client.generate(prompt, max_tokens=40, lora_name=lora, ignore_eos=True)
        n = 0
        async for batch in stream:
            n += len(batch)
        return n

    async def scrape_while(task: asyncio.Future) -> None:
        while not task.done():
            for row in await asyncio.to_thread(_lora_info, metrics):
                if row["instance"] == "l0" and row["running_lora_adapters"]:
                    seen_running.add(row["running_lora_adapters"])
            await asyncio.sleep(0.05)

    async def run() -> list[int]:
        async with AsyncClient(address, timeout=60) as client:
            work = asyncio.gather(*(one(client, p, lo) for p, lo in reqs))
            await asyncio.gather(work, scrape_while(work))
            return await work

    got = asyncio.run(run())
    assert got == [40] * len(reqs), "every request ends with its 40 tokens"
    wait_pool_free(address, timeout=30)
    rows = {r["instance"]: r for r in _lora_info(metrics)}
    assert rows["l0"]["max_lora"] == "2" and rows["l0"]["running_lora_adapters"] == ""
    assert "p0" not in rows, "an instance without adapters has no lora_requests_info"
    assert seen_running, "the scrape saw adapters running"
    assert all(len(s.split(",")) <= 2 for s in seen_running)
    # The worker's own count of every step it ran (its exit stats line).
    worker.stop()
    m = worker.wait_for(r"LoRA steps by adapters (\{[^}]*\}) \((\d+) over max_loras (\d+)\)")
    by_count = ast.literal_eval(m.group(1))
    assert int(m.group(3)) == 2 and int(m.group(2)) == 0
    assert max(by_count) == 2, f"the limit binds (steps by distinct adapters: {by_count})"
    assert sum(by_count.values()) > 0
