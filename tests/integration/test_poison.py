"""Poison quarantine end to end: a request that crashes its worker (the sim's injected fault,
`--crash-on-token`) takes its instance down at most poison_max_losses times, then ends with
FINISH_REASON_ERROR saying why; the instance recovers and the other requests it held finish
normally, with every token they would have had without the crashes."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import Outcome, Spec, generate
from tests.integration.harness import (
    Proc,
    start_daemon,
    start_worker,
    status,
    wait_pool_free,
    wait_ready,
)

POISON_TOKEN = 7777


async def _scenario(address: str, specs: list[Spec], poison: rpb.GenerateRequest) -> tuple:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        outs = [Outcome() for _ in specs]

        async def follow(spec: Spec, out: Outcome) -> None:
            got = await generate(stub, spec.message(), timeout=120)
            out.__dict__.update(got.__dict__)

        tasks = [asyncio.create_task(follow(s, o)) for s, o in zip(specs, outs, strict=True)]
        # The poison arrives while the others run on the instance.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and status(address).num_running < len(specs):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        bad = await generate(stub, poison, timeout=120)
        await asyncio.gather(*tasks)
        return outs, bad


def test_poison_request_is_quarantined_after_two_losses_and_the_rest_finish() -> None:
    daemon, address = start_daemon()
    worker = start_worker(
        address,
        "i0",
        "--crash-on-token",
        str(POISON_TOKEN),
        "--reconnect-min-s",
        "0.05",
        "--reconnect-max-s",
        "0.2",
    )
    try:
        wait_ready(address, ["i0"])
        specs = [Spec(f"ok-{i}", [11 + i] * 40, 300) for i in range(6)]
        poison = rpb.GenerateRequest(
            request_id="poison",
            prompt_token_ids=[1, 2, POISON_TOKEN, 3],
            sampling=common_pb2.SamplingParams(max_tokens=4),
        )
        outs, bad = asyncio.run(_scenario(address, specs, poison))

        assert bad.code is None, bad.details
        assert bad.finished.reason == common_pb2.FINISH_REASON_ERROR
        assert "quarantined as a poison request" in bad.finished.message
        assert "2 times" in bad.finished.message
        for spec, out in zip(specs, outs, strict=True):
            assert out.code is None, (spec.req_id, out.details)
            assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH, out.finished.message
            assert out.tokens == spec.expected, spec.req_id
        crashes = [ln for ln in worker.lines if "injected crash" in ln]
        assert len(crashes) == 2, "\n".join(crashes)
        assert any("poison" in ln and "quarantined" in ln for ln in daemon.lines)
        # The instance is back and serves the next request as if nothing happened.
        wait_ready(address, ["i0"])
        after = Spec("after", [5, 6, 7], 8)
        (got,) = asyncio.run(_after(address, after))
        assert got.tokens == after.expected
        wait_pool_free(address)
    finally:
        worker.stop()
        daemon.stop()


async def _after(address: str, spec: Spec) -> list[Outcome]:
    async with grpc.aio.insecure_channel(address) as ch:
        return [await generate(request_service_pb2_grpc.RequestServiceStub(ch), spec.message())]


async def _all(address: str, specs: list[Spec]) -> list[Outcome]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        return list(
            await asyncio.gather(*(generate(stub, s.message(), timeout=120) for s in specs))
        )


def test_a_silent_worker_is_not_counted_against_its_requests() -> None:
    """Issue 23: a rank silent past the heartbeat timeout (a paused worker or daemon, a
    partition) is the cluster's fault, not the requests': with poison_max_losses = 1 the
    requests it held before their first token are requeued and finish, none quarantined."""
    import threading

    env = {
        "KVSCHED_POISON_MAX_LOSSES": "1",
        "KVSCHED_HEARTBEAT_TIMEOUT_S": "1",
        "KVSCHED_HEARTBEAT_INTERVAL_S": "0.3",
    }
    daemon, address = start_daemon(env=env)
    fast = ("--reconnect-min-s", "0.05", "--reconnect-max-s", "0.2")
    worker = start_worker(address, "i0", *fast)
    try:
        wait_ready(address, ["i0"])
        worker.signal(signal.SIGSTOP)  # silent from now on: placed requests make no progress
        specs = [Spec(f"s-{i}", [21 + i] * 30, 12) for i in range(4)]

        def resume_worker() -> None:
            try:
                daemon.wait_for(r"instance i0 taken out: rank 0 silent", timeout=60)
            finally:
                worker.signal(signal.SIGCONT)

        t = threading.Thread(target=resume_worker)
        t.start()
        outs = asyncio.run(_all(address, specs))
        t.join(65)
        daemon.wait_for(r"instance i0 taken out: rank 0 silent", timeout=1)
        for spec, out in zip(specs, outs, strict=True):
            assert out.code is None, (spec.req_id, out.details)
            assert out.finished is not None
            assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH, out.finished.message
            assert out.tokens == spec.expected, spec.req_id
        assert not any("quarantined" in ln for ln in daemon.lines)
        wait_pool_free(address)
    finally:
        worker.signal(signal.SIGCONT)
        worker.stop()
        daemon.stop()


async def _submit_then_pause_daemon(address: str, specs: list[Spec], daemon: Proc) -> list:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        tasks = [asyncio.create_task(generate(stub, s.message(), timeout=120)) for s in specs]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and status(address).num_running < len(specs):
            await asyncio.sleep(0.02)
        daemon.signal(signal.SIGSTOP)  # the worker leaves it as silent (1.5 s), then reconnects
        await asyncio.sleep(4.0)
        daemon.signal(signal.SIGCONT)
        return list(await asyncio.gather(*tasks))


@pytest.mark.faults  # a pause scenario: `make test-faults` (a CI step)
def test_a_worker_that_left_a_paused_daemon_is_not_counted_against_its_requests() -> None:
    """Issue 23: the daemon paused (SIGSTOP) past its workers' silence bound; they leave it and
    their streams end, which the daemon reads when it continues. Not the requests' fault:
    with poison_max_losses = 1 none is quarantined; all finish with every token."""
    env = {
        "KVSCHED_POISON_MAX_LOSSES": "1",
        "KVSCHED_HEARTBEAT_TIMEOUT_S": "30",  # the stream's end, not silence, takes it out
        "KVSCHED_HEARTBEAT_INTERVAL_S": "0.3",
    }
    daemon, address = start_daemon(env=env)
    fast = ("--reconnect-min-s", "0.05", "--reconnect-max-s", "0.2", "--speed", "0.02")
    worker = start_worker(address, "i0", *fast)
    try:
        wait_ready(address, ["i0"])
        specs = [Spec(f"p-{i}", [31 + i] * 400, 6) for i in range(4)]
        outs = asyncio.run(_submit_then_pause_daemon(address, specs, daemon))
        worker.wait_for(r"leaving daemon", timeout=1)
        for spec, out in zip(specs, outs, strict=True):
            assert out.code is None, (spec.req_id, out.details)
            assert out.finished is not None
            assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH, out.finished.message
            assert out.tokens == spec.expected, spec.req_id
        assert not any("quarantined" in ln for ln in daemon.lines)
    finally:
        daemon.signal(signal.SIGCONT)
        worker.stop()
        daemon.stop()
