"""An engine publishes its instance's one load value (`InstanceEngine.load`): the core's
`instance_load` of its scheduler's facts, current after every call that changes them (not only
after a step), the number the daemon's router places by and the one a cluster publishes.
Through the real daemon (in process, real sim workers over gRPC on loopback)."""

from __future__ import annotations

import asyncio

from kvsched.core import FinishReason, Request, SamplingParams
from kvsched.core.router import instance_load
from kvsched.server.instances.engine import InstanceEngine
from tests.server.telemetry_harness import running_daemon


def _request(req_id: str, prompt_len: int) -> Request:
    return Request(req_id, [1 + i % 500 for i in range(prompt_len)], SamplingParams(max_tokens=4))


def _formula(eng: InstanceEngine) -> float:
    return instance_load(eng.load_facts(), eng.load_seconds, by_count=eng.is_decode)


def test_the_engine_load_is_current_and_is_what_routing_and_the_cluster_read() -> None:
    async def go() -> None:
        async with running_daemon({}, instances=("i0", "i1")) as h:
            registry = h.daemon.registry
            # In the registry's order (the workers' attach order): the router's tie order.
            i0, i1 = registry.engines.values()
            assert i0.load_seconds == registry.router.load_seconds
            for eng in (i0, i1):
                assert eng.load == _formula(eng)
            idle = i0.load
            # No await from here on: the engines run no step, so only the calls below change
            # their schedulers' facts.
            long = _request("long", 2000)
            i0.add_request(long)  # ~2,000 prompt tokens queued on the first instance
            assert i0.load == _formula(i0) > idle
            assert i0.published_load()["load"] == round(i0.load, 6)
            # Two idle-looking instances tie, and the router takes the first on ties: it
            # places on the second only because the first's load value counts the queued prompt.
            assert registry.route(_request("next", 16)) is i1
            i0.abort("long", FinishReason.ABORT, "test: taken back")
            assert i0.load == _formula(i0) == idle
            assert registry.route(_request("after", 16)) is i0
            await asyncio.sleep(0)

    asyncio.run(go())
