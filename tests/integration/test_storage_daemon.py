"""The storage tier through the real daemon (`kvsched serve --storage`) and real sim workers
(which simulate the store: every task succeeds, priced by bandwidth): a prefix one instance
computed and evicted is written to the store and fetched by another instance; the counters
show on AdminService status and /metrics; the Welcome names the store only to a worker that
lists its kind in Hello.storage_backends (a raw worker: the test writes the Hello)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc

from kvsched.v1 import request_service_pb2_grpc
from tests.integration.clients import Spec, generate, run
from tests.integration.harness import start_daemon, start_worker, status, wait_ready
from tests.integration.rawworker import RawWorker, hello

BS = 16
SMALL = ("--num-blocks", "24", "--block-size", str(BS))  # a prefix is evicted by two others


def serve(specs: list[Spec], address: str) -> list[str]:
    """Send `specs` one after the other; each must finish with the sim's tokens. Returns the
    instances that served them."""

    async def go() -> list[str]:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            out = []
            for spec in specs:
                o = await generate(stub, spec.message(), timeout=30)
                assert o.finished is not None and o.tokens == spec.expected, (spec.req_id, o)
                out.append(o.instance)
            return out

    return run(go())


def wait_idle(address: str, instance: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(address, instance).instances[0]
        if st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_gpu_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"{instance} not idle: {status(address, instance)}")


def test_a_prefix_evicted_on_one_instance_is_fetched_by_another() -> None:
    daemon, address = start_daemon("--storage", "mooncake", "--metrics-listen", "127.0.0.1:0")
    target = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
    w0 = start_worker(address, "i0", *SMALL)
    w1 = None
    try:
        wait_ready(address, ["i0"])
        prefix = list(range(1000, 1000 + 10 * BS))  # 10 full blocks
        fill = [list(range(5000 + 1000 * k, 5000 + 1000 * k + 20 * BS)) for k in range(2)]
        serve(
            [
                Spec("p0", prefix + [1, 2, 3], 4),
                Spec("f0", fill[0] + [7], 2),  # evicts p0's blocks: written (write_back)
                Spec("f1", fill[1] + [7], 2),
            ],
            address,
        )
        wait_idle(address, "i0")
        st0 = status(address, "i0").instances[0]
        assert st0.num_storage_writes >= 10, st0
        w0.stop()
        w1 = start_worker(address, "i1", *SMALL)
        wait_ready(address, ["i1"])
        (where,) = serve([Spec("p1", prefix + [4, 5, 6], 4)], address)
        assert where == "i1"
        wait_idle(address, "i1")
        st1 = status(address, "i1").instances[0]
        assert st1.prefix_cache_storage_hit_tokens == 10 * BS, st1
        assert st1.num_storage_fetches == 10 and st1.num_storage_failures == 0
        text = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
        line = next(
            ln
            for ln in text.splitlines()
            if ln.startswith("kvsched_prefix_cache_storage_hits_total") and 'instance="i1"' in ln
        )
        assert float(line.rsplit(" ", 1)[1]) == 10 * BS
    finally:
        for w in (w0, w1):
            if w is not None:
                w.stop()
        daemon.stop()


def test_the_welcome_names_the_store_only_to_a_worker_that_reaches_it() -> None:
    url = "mooncake://127.0.0.1:7777"
    daemon, address = start_daemon("--storage", url)

    async def go() -> tuple[str, str]:
        async with grpc.aio.insecure_channel(address) as ch:
            yes = RawWorker(ch, hello("a", storage_backends=["mooncake"]))
            no = RawWorker(ch, hello("b", storage_backends=["files"]))
            try:
                wa = await yes.read("welcome")
                wb = await no.read("welcome")
                return wa.storage_url, wb.storage_url
            finally:
                yes.close()
                no.close()

    try:
        got = asyncio.run(go())
        assert got == (url, "")
    finally:
        daemon.stop()
