"""A worker that breaks the protocol gets FAILED_PRECONDITION and its instance is taken out;
nothing else is affected. The misbehaving worker here is a raw gRPC stream written by hand."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvsched.codec import PROTOCOL_VERSION
from kvsched.v1 import request_service_pb2_grpc, worker_service_pb2_grpc
from kvsched.v1 import worker_service_pb2 as wpb
from tests.integration.clients import Spec, generate, run
from tests.integration.harness import start_daemon, start_worker, status, wait_pool_free, wait_ready


@pytest.fixture(scope="module")
def daemon_with_good_worker():
    daemon, address = start_daemon()
    good = start_worker(address, "good", "--zero-cost")
    try:
        wait_ready(address, ["good"])
        yield address
    finally:
        good.stop()
        daemon.stop()


def hello(instance: str, version: int = PROTOCOL_VERSION, rank: int = 0) -> wpb.ConnectRequest:
    return wpb.ConnectRequest(
        hello=wpb.Hello(
            instance_id=instance,
            rank=rank,
            world_size=1,
            num_gpu_blocks=64,
            block_size=16,
            num_slots=8,
            protocol_version=version,
        )
    )


async def _exchange(address: str, messages: list[wpb.ConnectRequest]) -> grpc.aio.AioRpcError:
    """Send `messages` on one Connect stream and return the error the daemon ends it with."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_service_pb2_grpc.WorkerServiceStub(ch)
        gate = asyncio.Event()

        async def gen():
            yield messages[0]
            await gate.wait()
            for m in messages[1:]:
                yield m
            await asyncio.sleep(30)

        call = stub.Connect(gen())
        try:
            first = await call.read()
            assert first.WhichOneof("kind") == "welcome"
            gate.set()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError("the daemon accepted the violation")


def report(step: int, applied: int = 0, **cols) -> wpb.ConnectRequest:
    return wpb.ConnectRequest(report=wpb.StepReport(step=step, applied_seq=applied, **cols))


@pytest.mark.parametrize(
    ("name", "messages", "needle"),
    [
        (
            "unknown handle",
            [report(1, handles=[77], num_computed=[1], num_new_tokens=[0], finish_reasons=[0])],
            "never issued",
        ),
        ("tasks never sent", [report(1, applied=9)], "applied tasks 9"),
        ("second hello", [hello("bad-hello")], "second Hello"),
        (
            "bad columns",
            [report(1, handles=[0], num_computed=[], num_new_tokens=[0])],
            "StepReport",
        ),
        ("step not increasing", [report(2), report(2)], "steps must increase"),
    ],
)
def test_protocol_violation_takes_only_that_instance_out(
    daemon_with_good_worker: str, name: str, messages: list, needle: str
) -> None:
    address = daemon_with_good_worker
    instance = f"bad-{name.replace(' ', '-')}"
    err = run(_exchange(address, [hello(instance), *messages]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert needle in (err.details() or ""), err.details()
    states = {i.instance_id: i for i in status(address).instances}
    assert not states[instance].ready
    assert states["good"].ready

    async def still_serving() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            out = await generate(stub, Spec(f"ok-{instance}", [5, 6, 7], 4).message())
            assert out.finished is not None and out.instance == "good"

    run(still_serving())
    wait_pool_free(address)


def test_wrong_protocol_version_and_missing_hello(daemon_with_good_worker: str) -> None:
    address = daemon_with_good_worker

    async def go(first: wpb.ConnectRequest) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_service_pb2_grpc.WorkerServiceStub(ch)

            async def gen():
                yield first
                await asyncio.sleep(30)

            call = stub.Connect(gen())
            try:
                await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc
            raise AssertionError("accepted")

    err = run(go(hello("v99", version=99)))
    assert (
        err.code() == grpc.StatusCode.FAILED_PRECONDITION and "protocol version 99" in err.details()
    )
    err = run(go(wpb.ConnectRequest(heartbeat=wpb.Heartbeat(time_ns=1))))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "Hello" in err.details()
