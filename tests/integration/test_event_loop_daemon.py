"""The daemon and the worker on uvloop (KVSCHED_EVENT_LOOP=uvloop): real processes, exact tokens,
every block returned; a bad value is refused at start with the variable named."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvsched.v1 import request_service_pb2_grpc
from tests.integration.clients import Outcome, generate, mixed_specs, run
from tests.integration.harness import Proc, start_daemon, wait_pool_free, wait_ready

pytest.importorskip("uvloop")
UV = {"KVSCHED_EVENT_LOOP": "uvloop"}


def test_daemon_and_worker_on_uvloop_serve_exact_tokens() -> None:
    daemon, address = start_daemon(env=UV)
    worker = Proc(
        [
            "worker",
            "--server",
            address,
            "--instance",
            "i0",
            "--executor",
            "sim",
            "--zero-cost",
            "--num-blocks",
            "3000",
        ],
        UV,
        "worker-i0",
    )
    try:
        wait_ready(address, ["i0"])
        daemon.wait_for(r"event loop: uvloop")
        worker.wait_for(r"event loop: uvloop")
        specs = mixed_specs(60, seed=7)

        async def go() -> list[Outcome]:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                return await asyncio.gather(*(generate(stub, s.message()) for s in specs))

        for spec, out in zip(specs, run(go()), strict=True):
            assert out.code is None, (spec.req_id, out.code, out.details)
            assert out.finished is not None and out.tokens == spec.expected, spec.req_id
        wait_pool_free(address)
    finally:
        worker.stop()
        daemon.stop()


def test_a_bad_event_loop_is_refused_naming_the_variable() -> None:
    for args in (
        ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
        ["worker", "--server", "127.0.0.1:9", "--executor", "sim"],
    ):
        proc = Proc(args, {"KVSCHED_EVENT_LOOP": "tokio"}, args[0])
        assert proc.popen.wait(30) == 2, args[0]
        assert any("KVSCHED_EVENT_LOOP must be one of" in line for line in proc.lines), args[0]
