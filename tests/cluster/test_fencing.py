"""Fencing tokens (protocol step 12) with a real nats-server, real daemons and sim workers: a
daemon whose lease on an instance was taken by compare-and-set stops driving its worker, which
moves to the new owner under a strictly larger epoch; a daemon holding only an older epoch (or
none) is refused by the worker; requests in flight still end with exactly the sim's tokens."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from kvsched.client import AsyncClient
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.leases import Lease
from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from tests.cluster.durability_kit import (
    Daemon,
    prompts,
    sim_expected,
    start_sim_worker,
    take_lease,
    until_tokens,
)
from tests.integration.clients import Outcome, Spec, generate
from tests.integration.harness import Proc, status, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)


def _ready(address: str) -> dict[str, bool]:
    return {i.instance_id: i.ready for i in status(address).instances}


async def _stream_and_take(
    addr: str, url: str, requests: list[tuple[str, list[int], int]]
) -> tuple[list[list[int]], Lease, Lease]:
    async with AsyncClient(addr, options=RESUMABLE_CHANNEL_OPTIONS) as client:
        streams = [
            resumable(client, p, request_id=rid, max_tokens=n, retry_for_s=90)
            for rid, p, n in requests
        ]
        tasks = [asyncio.create_task(s.read_all()) for s in streams]
        await until_tokens(streams, tasks, 5, "takeover", 60)
        before, after = await take_lease(url, "fe-b", "fe0", "fe-a")
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        return [s.tokens for s in streams], before, after


def test_taken_lease_fences_the_old_daemon_and_the_worker_follows(
    nats_server: NatsServer,
) -> None:
    a = Daemon(nats_server.url, "fe-a").start()
    b = Daemon(nats_server.url, "fe-b").start()
    workers: list[Proc] = []
    try:
        # fe0 knows both daemons (a first); fe1 only a: where a's requests move to.
        both = f"{a.address},{b.address}"
        workers.append(start_sim_worker(both, "fe0", "--speed", "0.3", "--reconnect-max-s", "0.5"))
        wait_ready(a.address, ["fe0"], 60.0)
        workers.append(start_sim_worker(a.address, "fe1", "--speed", "0.3"))
        wait_ready(a.address, ["fe1"], 60.0)
        w0 = workers[0]
        first = w0.wait_for(r"welcomed by")
        requests = [(f"fe-{i}", p, 120) for i, p in enumerate(prompts(8, seed=23))]
        got, before, after = asyncio.run(
            asyncio.wait_for(_stream_and_take(a.address, nats_server.url, requests), 150)
        )
        # Every request ended with exactly the tokens of an uninterrupted run.
        for (rid, p, n), tokens in zip(requests, got, strict=True):
            assert tokens == sim_expected(rid, len(p), n), rid
        # The epoch only grew; the old owner handed the instance to the lease's new holder.
        assert after.revision > before.revision
        assert a.proc is not None
        a.proc.wait_for(
            rf"lease of instance fe0 taken by daemon fe-b \(epoch {after.revision} > "
            rf"{before.revision}\)"
        )
        a.proc.wait_for(r"instance fe0 taken out: lease taken by daemon fe-b")
        w0.wait_after(first.string, r"redirected from \S+ to " + re.escape(b.address), timeout=30)
        w0.wait_for(rf"instance fe0: fencing epoch {before.revision} -> {after.revision}")
        wait_ready(b.address, ["fe0"], 30.0)
        assert not _ready(a.address).get("fe0")

        # The old owner can no longer drive the worker: with NATS gone it would attach the
        # worker without a lease (epoch 0 < the worker's); the worker refuses it.
        nats_server.stop()
        b.kill9()  # the worker's stream to fe-b breaks; it tries fe-a next
        w0.wait_for(
            rf"refusing daemon {re.escape(a.address)}: its Welcome carries fencing epoch 0, "
            rf"below {after.revision}",
            timeout=60,
        )
    finally:
        if nats_server.proc is None:
            nats_server.start()  # the module's server, for the tests after this one
        for p in reversed(workers):
            p.stop()
        a.stop()
        b.stop()


async def _generate_through(address: str, specs: list[Spec]) -> list[Outcome]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = request_service_pb2_grpc.RequestServiceStub(ch)
        return [await generate(stub, s.message(), timeout=60) for s in specs]


def test_a_daemon_whose_instances_were_all_taken_routes_new_requests_to_the_peer(
    nats_server: NatsServer,
) -> None:
    """Issue 23: a daemon whose only instance was taken by a peer (it was paused or cut off)
    still knows the instance (its engine, without a worker, until forget_lost_instance_s):
    it must not hide the peer's instance of the same id from its router, but forward new
    requests there instead of refusing them with 'no instance is ready'."""
    a = Daemon(nats_server.url, "fr-a").start()
    b = Daemon(nats_server.url, "fr-b").start()
    worker = start_sim_worker(f"{a.address},{b.address}", "fr0", "--reconnect-max-s", "0.5")
    try:
        wait_ready(a.address, ["fr0"], 60.0)
        asyncio.run(take_lease(nats_server.url, "fr-b", "fr0", "fr-a"))
        assert a.proc is not None
        a.proc.wait_for(r"instance fr0 taken out: lease taken by daemon fr-b", timeout=30)
        wait_ready(b.address, ["fr0"], 30.0)
        assert not _ready(a.address).get("fr0")  # a keeps the engine, with no worker
        # Once a has heard b's instance (its KV events and load: a few 100 ms), a request
        # sent to a runs on b's fr0; bounded: 20 s.
        deadline = time.monotonic() + 20.0
        n, first = 0, None
        while time.monotonic() < deadline:
            n += 1
            (first,) = asyncio.run(_generate_through(a.address, [Spec(f"fr-try-{n}", [9] * 20, 4)]))
            if first.code is None:
                break
            time.sleep(0.2)
        assert first is not None and first.code is None, (n, first.code, first.details)
        # From then on every request sent to a is forwarded, none refused.
        specs = [Spec(f"fr-{i}", [30 + i] * 25, 16) for i in range(6)]
        for spec, out in zip(specs, asyncio.run(_generate_through(a.address, specs)), strict=True):
            assert out.code is None, (spec.req_id, out.details)
            assert out.finished is not None
            assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH
            assert out.tokens == sim_expected(spec.req_id, len(spec.prompt), 16)
            assert out.instance == "fr0"
    finally:
        worker.stop()
        a.stop()
        b.stop()
