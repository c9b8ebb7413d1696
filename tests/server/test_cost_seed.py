"""An instance whose scheduler starts (its workers joined, or came back) is priced by the step
cost already learned here, not by the config's default-GPU seed: a sibling instance's fit of
the same model when it never ran here, its own previous scheduler's fit when it ran here
before. The router spreads work by these prices the moment the instance joins (issue 38: a
takeover's adopted requests piled on the dead daemon's freshly moved workers, priced 4x too
cheap). Through the real daemon (in process, real sim workers over gRPC on loopback)."""

from __future__ import annotations

import asyncio

import pytest

from kvsched.core.config import StepCostConfig
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.client import Worker, sim_engine_factory
from tests.server.telemetry_harness import Harness, running_daemon

SPEED = 0.25  # the workers' steps take 4x the seed's (the default GPU's) time


def _worker(h: Harness, iid: str) -> None:
    w = Worker(
        f"127.0.0.1:{h.port}",
        iid,
        sim_engine_factory(16, speed=SPEED),
        num_gpu_blocks=512,
        block_size=16,
        num_slots=16,
        reconnect_backoff_s=(0.01, 0.05),
    )
    h.workers[iid] = w
    h.tasks[iid] = asyncio.get_running_loop().create_task(w.run())


def test_a_joining_instance_starts_from_the_fit_learned_here() -> None:
    seed = StepCostConfig().per_prefill_token_ms

    async def go() -> None:
        async with running_daemon({}, zero_cost=False, speed=SPEED, instances=("i0",)) as h:
            engines = h.daemon.registry.engines
            i0 = engines["i0"]
            assert i0.learned_cost() is None  # nothing learned before a step
            for k in range(12):  # prompts of 100-1,200 tokens (no prefix shared): per token
                n = 100 + 100 * k
                msg = rpb.GenerateRequest(
                    request_id=f"r{k}",
                    prompt_token_ids=[3 + (k * 2477 + i * 31) % 29000 for i in range(n)],
                    sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
                )
                assert (await h.generate(msg)).finished is not None
            fit = i0.learned_cost()
            assert fit is not None
            assert fit[1] > 2 * seed, (fit, seed)  # learned the slower worker (4x the seed)

            # A second instance of the same model joins: priced by i0's fit from the start.
            _worker(h, "i1")
            await h.wait_ready()
            assert engines["i1"].published_load()["prefill_token_ms"] == pytest.approx(fit[1])

            # i0 taken out and back (its worker reconnects): its own previous fit again.
            await h.stop_worker("i0")
            _worker(h, "i0")
            await h.wait_ready()
            assert engines["i0"].published_load()["prefill_token_ms"] == pytest.approx(fit[1])

    asyncio.run(go())


def test_without_a_fit_learned_here_an_instance_starts_from_the_config_seed() -> None:
    async def go() -> None:
        async with running_daemon({}, zero_cost=False, instances=("i0", "i1")) as h:
            for eng in h.daemon.registry.engines.values():
                assert eng.published_load()["prefill_token_ms"] == pytest.approx(
                    StepCostConfig().per_prefill_token_ms
                )

    asyncio.run(go())
