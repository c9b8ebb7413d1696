"""An Abort with reason STOP (a front end's stop string) keeps its reason when it crosses the
cluster: a request relayed to a peer, and one the asked daemon does not track (the abort bus),
both end as stopped on the daemon that ran them (its `kvsched_request_success_total` counts
`stop`, not `abort`), and their clients hear reason STOP."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.conftest import start_cluster
from tests.integration.clients import generate

STOP = common_pb2.FINISH_REASON_STOP


def _finished(metrics_addr: str) -> dict[str, float]:
    """kvsched_request_success_total by finished_reason (all instances)."""
    text = httpx.get(f"http://{metrics_addr}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvsched_request_success_total":
                r = s.labels["finished_reason"]
                out[r] = out.get(r, 0.0) + s.value
    return out


def test_stop_keeps_its_reason_across_daemons(nats_server: NatsServer) -> None:
    cluster = start_cluster(
        nats_server.url,
        "st",
        2,
        1,
        worker_args=("--speed", "0.5"),  # slow steps: still running when stopped
        daemon_args=("--metrics-listen", "127.0.0.1:0"),
    )
    try:
        a, b = cluster.addresses
        metrics_b = cluster.daemons[1].wait_for(r"kvsched metrics on (\S+:\d+)").group(1)

        def long(rid: str) -> rpb.GenerateRequest:
            return rpb.GenerateRequest(
                request_id=rid,
                prompt_token_ids=list(range(5, 40)),
                sampling=common_pb2.SamplingParams(max_tokens=5000, ignore_eos=True),
            )

        async def go() -> None:
            async with grpc.aio.insecure_channel(a) as cha, grpc.aio.insecure_channel(b) as chb:
                sa = request_service_pb2_grpc.RequestServiceStub(cha)
                sb = request_service_pb2_grpc.RequestServiceStub(chb)
                admin_a = admin_service_pb2_grpc.AdminServiceStub(cha)
                await admin_a.Drain(apb.DrainRequest(instance_id="st0"), timeout=5)
                cases = []
                for rid, stub in (("relayed", sa), ("elsewhere", sb)):
                    queued = asyncio.Event()
                    task = asyncio.create_task(generate(stub, long(rid), queued=queued, timeout=60))
                    await asyncio.wait_for(queued.wait(), 20)
                    cases.append((rid, task))
                await asyncio.sleep(0.5)  # both are decoding on st1 (daemon b)
                for rid, _ in cases:  # through daemon a: relayed from there, unknown there
                    await sa.Abort(rpb.AbortRequest(request_id=rid, reason=STOP), timeout=10)
                for rid, task in cases:
                    out = await asyncio.wait_for(task, 30)
                    assert out.instance == "st1", (rid, out.instance)
                    assert out.finished is not None and out.finished.reason == STOP, (rid, out)
                    assert 0 < len(out.tokens) < 5000

        asyncio.run(go())
        # The relayed one's client heard STOP from daemon a at once; daemon b is told next.
        deadline = time.monotonic() + 10
        while (got := _finished(metrics_b)).get("stop", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got.get("stop", 0) == 2, got
        assert got.get("abort", 0) == 0, got
    finally:
        cluster.stop()
