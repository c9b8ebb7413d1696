"""Overload and misbehaving clients: queue limits, queue timeouts, deadlines, stalled readers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import time

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from tests.integration.clients import Spec, generate, run
from tests.integration.harness import (
    child_env,
    start_daemon,
    start_worker,
    status,
    wait_pool_free,
    wait_ready,
)

ABORT = common_pb2.FINISH_REASON_ABORT


def config(text: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    return f.name


def test_queue_limit_queue_timeout_and_deadline() -> None:
    cfg = config("queue_timeout_s = 1.0\n[engine.scheduler]\nmax_waiting = 3\n")
    daemon, address = start_daemon("--config", cfg)
    # speed 5: the hog (5000 tokens) holds the only slot for ~6 s, past the 1 s queue timeout
    worker = start_worker(address, "w", "--speed", "5", "--num-slots", "1", "--num-blocks", "500")
    try:
        wait_ready(address, ["w"])

        async def go() -> None:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                hog = stub.Generate(Spec("hog", [7] * 20, 5000).message())
                await hog.read()
                await hog.read()  # running: it holds the only slot
                waiting = [
                    asyncio.ensure_future(generate(stub, Spec(f"q{i}", [9] * 20, 5).message()))
                    for i in range(3)
                ]
                while status(address).num_waiting < 3:
                    await asyncio.sleep(0.02)
                full = await generate(stub, Spec("one-too-many", [9] * 20, 5).message())
                assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED, full
                assert "waiting queue is full" in full.details
                # Nobody gets the slot within queue_timeout_s: they end with a reason.
                for out in await asyncio.gather(*waiting):
                    assert out.finished.reason == ABORT and "queue timeout" in out.finished.message
                hog.cancel()
                # A gRPC deadline is honoured: the request ends and its blocks come back. The
                # daemon's own timer and the client's deadline race, and either way the call
                # ends DEADLINE_EXCEEDED: the daemon never answers a request it aborted past
                # its call's deadline with a Finished (the client has stopped waiting).
                late = await generate(stub, Spec("deadline", [5] * 20, 5000).message(), timeout=0.5)
                assert late.finished is None, late.finished
                assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED, late
                assert len(late.tokens) < 5000

        run(go())
        wait_pool_free(address)
    finally:
        worker.stop()
        daemon.stop()


STALLED_CLIENT = """
import asyncio, sys, grpc
from kvsched.v1 import common_pb2, request_service_pb2 as rpb, request_service_pb2_grpc

async def main(address):
    # No BDP probing: the flow-control window stays at its initial 64 KiB, so the daemon's
    # writes block soon after the client freezes, however fast the daemon produces tokens.
    async with grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        async def submits():
            for i in range(200):
                req = rpb.GenerateRequest(
                    request_id=f"stall{i}", prompt_token_ids=[i + 3] * 16,
                    sampling=common_pb2.SamplingParams(max_tokens=60000, ignore_eos=True))
                yield rpb.SessionRequest(submit=rpb.SessionRequest.Submit(request=req))
            await asyncio.sleep(3600)
        call = stub.Session(submits())
        await call.read()
        print("reading", flush=True)
        while await call.read() is not grpc.aio.EOF:
            pass

asyncio.run(main(sys.argv[1]))
"""


def test_stalled_session_reader_is_cut_and_its_requests_aborted() -> None:
    """A front end that stops reading (here: frozen with SIGSTOP, so its socket fills up) is
    disconnected after stall_timeout_s and its requests aborted; memory does not grow."""
    daemon, address = start_daemon("--config", config("stall_timeout_s = 1.0\n"))
    # 200 requests x 60k tokens: more output than the kernel's and gRPC's buffers can absorb.
    worker = start_worker(
        address,
        "w",
        "--zero-cost",
        "--block-size",
        "64",
        "--num-blocks",
        "200000",
        "--num-slots",
        "256",
    )
    client = None
    try:
        wait_ready(address, ["w"])
        client = subprocess.Popen(
            [sys.executable, "-c", STALLED_CLIENT, address],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        assert client.stdout is not None and client.stdout.readline().strip() == "reading"
        deadline = time.monotonic() + 30
        while status(address).num_running < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.send_signal(signal.SIGSTOP)
        daemon.wait_for("cutting a stream that has not read its outputs", timeout=60)
        wait_pool_free(address, timeout=20)
    finally:
        if client is not None:
            client.kill()
            client.wait()
        worker.stop()
        daemon.stop()
