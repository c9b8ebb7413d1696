"""Models and their limits end to end: each instance serves the model its worker's Hello names
and holds the limits it announced; requests route by GenerateRequest.model and are refused at
once when no instance of their model could run them (real daemon, real worker processes)."""

from __future__ import annotations

import asyncio

import pytest

from kvsched.client import AsyncClient, Client, InvalidArgument, ModelInfo, NotFound
from tests.integration.harness import start_daemon, start_worker, status, wait_ready


@pytest.fixture(scope="module")
def two_models():
    daemon, address = start_daemon()
    workers = [
        start_worker(address, "a0", "--zero-cost", "--served-model-name", "alpha"),
        start_worker(address, "a1", "--zero-cost", "--served-model-name", "alpha"),
        start_worker(
            address,
            "b0",
            "--zero-cost",
            "--served-model-name",
            "beta",
            "--max-model-len",
            "1000",
        ),
    ]
    try:
        wait_ready(address, ["a0", "a1", "b0"])
        yield address
    finally:
        for w in workers:
            w.stop()
        daemon.stop()


def test_requests_go_to_the_instances_of_their_model(two_models: str) -> None:
    with Client(two_models, timeout=30) as client:
        for i in range(12):
            alpha = client.generate([5 + i, 6, 7], max_tokens=3, model="alpha")
            assert alpha.instance in ("a0", "a1")
            assert len(alpha.tokens()) == 3
            beta = client.generate([5 + i, 6, 7], max_tokens=3, model="beta")
            assert beta.instance == "b0"
            assert len(beta.tokens()) == 3


def test_unknown_model_is_not_found_naming_the_served_ones(two_models: str) -> None:
    with Client(two_models, timeout=30) as client:
        with pytest.raises(NotFound) as e:
            client.generate([1, 2, 3], max_tokens=2, model="gamma")
        assert "gamma" in e.value.message
        assert "'alpha'" in e.value.message and "'beta'" in e.value.message
        # No model named, the daemon's configured one ("default") not served, two served:
        # the caller must choose.
        with pytest.raises(InvalidArgument) as e2:
            client.generate([1, 2, 3], max_tokens=2)
        assert "'alpha'" in e2.value.message and "'beta'" in e2.value.message


def test_list_models_lists_both_with_their_limits(two_models: str) -> None:
    with Client(two_models, timeout=30) as client:
        models = {m.name: m for m in client.list_models()}
    assert set(models) == {"alpha", "beta"}
    assert models["alpha"] == ModelInfo("alpha", 131072, 32000, 2)
    assert models["beta"] == ModelInfo("beta", 1000, 32000, 1)

    async def from_aio() -> list[ModelInfo]:
        async with AsyncClient(two_models, timeout=30) as client:
            return await client.list_models()

    assert sorted(asyncio.run(from_aio()), key=lambda m: m.name) == [
        models["alpha"],
        models["beta"],
    ]


def test_a_request_over_one_models_limit_is_refused_for_that_model_only(two_models: str) -> None:
    with Client(two_models, timeout=30) as client:
        with pytest.raises(InvalidArgument) as e:
            client.generate([1] * 990, max_tokens=20, model="beta")
        assert "max_model_len 1000" in e.value.message
        assert len(client.generate([1] * 990, max_tokens=20, model="alpha").tokens()) == 20


def test_status_groups_instances_by_model(two_models: str) -> None:
    from kvsched.server.status_view import format_status

    lines = format_status(status(two_models)).splitlines()
    assert lines[0].split()[0] == "model"
    firsts = [ln.split()[0] for ln in lines[1:4]]
    assert firsts == ["alpha", "alpha", "beta"]


@pytest.fixture(scope="module")
def model_worker():
    daemon, address = start_daemon()
    worker = start_worker(
        address, "m0", "--executor", "model", "--backend", "numpy", "--num-blocks", "512"
    )
    try:
        wait_ready(address, ["m0"], timeout=120)
        yield daemon, worker, address
    finally:
        worker.stop()
        daemon.stop()


def test_model_worker_limits_refuse_at_once(model_worker) -> None:
    daemon, _worker, address = model_worker
    with Client(address, timeout=30) as client:
        (info,) = client.list_models()
        assert (info.max_model_len, info.vocab_size) == (4096, 2048)
        with pytest.raises(InvalidArgument) as e:
            client.generate([1] * 5000, max_tokens=4)
        assert "max_model_len 4096" in e.value.message
        with pytest.raises(InvalidArgument) as e:
            client.generate([1, 10**9, 2], max_tokens=4)
        assert "vocab_size 2048" in e.value.message and "1000000000" in e.value.message
        with pytest.raises(InvalidArgument) as e:
            client.generate([1, 2], max_tokens=4, stop_token_ids=[5000])
        assert "stop_token_ids" in e.value.message
        # The worker never saw them: it serves a valid request, still on its first connection.
        assert len(client.generate([1, 2, 3], max_tokens=4).tokens()) == 4
    assert not any("taken out" in ln or "lost" in ln for ln in daemon.lines)
    assert sum("worker connected" in ln for ln in daemon.lines) == 1
