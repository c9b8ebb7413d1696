"""A worker whose Hello does not announce `multimodal` (as the vLLM worker's does not: no
encoder inputs reach vLLM's runner) never gets a request with multimodal items: the daemon
places such a request only on an instance that announced it (the sim worker does: it prices
items), and refuses it before queueing, INVALID_ARGUMENT naming `mm_ranges`, when no instance
of its model announced it. Real daemon and sim worker; the others are raw Connect streams."""

from __future__ import annotations

import asyncio

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.harness import start_daemon, start_worker, wait_ready
from tests.integration.rawworker import RawWorker, hello

PROMPT = list(range(1, 41))
ITEM = common_pb2.MultimodalRange(offset=8, length=16, content_hash="img-1")


def request(model: str, items: bool = True) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        model=model,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=2),
        mm_ranges=[ITEM] if items else [],
    )


async def _check(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        # "mm-raw" serves model "m" beside the sim worker; "vl" serves model "v" alone. Neither
        # announces multimodal (a Hello's default).
        raws = [RawWorker(ch, hello("mm-raw", model="m")), RawWorker(ch, hello("vl", model="v"))]
        for w in raws:
            await w.read("welcome")
        # The sim worker attaches after mm-raw: by the router's order alone mm-raw would win.
        sim = start_worker(address, "mm-sim", "--zero-cost", "--served-model-name", "m")
        try:
            wait_ready(address, ["mm-sim"])
            rs = request_service_pb2_grpc.RequestServiceStub(ch)
            plain = rs.Generate(request("m", items=False), timeout=30)
            assert (await plain.read()).queued.instance == "mm-raw"  # (that order, shown)
            plain.cancel()
            for _ in range(4):  # never on mm-raw: always on the sim worker
                call = rs.Generate(request("m"), timeout=30)
                assert (await call.read()).queued.instance == "mm-sim"
                while (msg := await call.read()) is not grpc.aio.EOF:
                    last = msg
                assert last.finished.usage.output_tokens == 2
        finally:
            sim.stop()
        try:
            await rs.Generate(request("v"), timeout=30).read()
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "mm_ranges" in (exc.details() or ""), exc.details()
            assert "'v'" in (exc.details() or "")
        else:
            raise AssertionError("a request with multimodal items was queued on model 'v'")
        # The same prompt without items is queued there (the raw worker runs nothing: the
        # request waits, and is aborted when the stream is dropped).
        call = rs.Generate(request("v", items=False), timeout=30)
        first = await call.read()
        assert first.queued.instance == "vl"
        call.cancel()
        for w in raws:
            w.call.cancel()


def test_multimodal_items_never_reach_a_worker_that_does_not_announce_them() -> None:
    daemon, address = start_daemon()
    try:
        asyncio.run(asyncio.wait_for(_check(address), 60))
    finally:
        daemon.stop()
