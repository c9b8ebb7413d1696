"""A forwarder whose client left does not take the request back (issue 23; 12 of the 13
requests the 30-minute nemesis run of 2784789 lost): real daemons on a real nats-server, a sim
worker, the chaos harness's TCP proxy between the daemons, loopback.

`fl-a` has no instance: it forwards to `fl-b`'s. `fl-b` advertises a proxy, so peers reach it
through that proxy while clients and its worker reach it directly. With the proxy cut (bytes
held, as in a partition), a client's Generate at `fl-a` gets no answer (`fl-a` waits for `fl-b`
to accept before telling it `queued`); the client gives up on `fl-a` and submits the same
request straight to `fl-b`, which runs it. When the partition heals, `fl-a`'s forward reaches
`fl-b` and is refused as the same request live there (RequestAlreadyLive). Following it there
by Resume, as a forwarder does for its own client, would take the stream from the client that
now reads it at `fl-b` (its stream would end without Finished): `fl-a`, whose client left,
lets the request run on at `fl-b`. The client gets every token once and one Finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from bench.chaos.proxy import ProxySet
from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.durability_kit import (
    Daemon,
    read_rest,
    routes_to,
    sim_expected,
    start_sim_worker,
)
from tests.integration.clients import Spec
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

MAX_TOKENS = 60  # at --speed 0.1 a few seconds of decoding: live on b through the heal


@pytest.fixture(scope="module")
def cut_pair(nats_server: NatsServer) -> Iterator[tuple[Daemon, Daemon, ProxySet]]:
    proxies = ProxySet()
    b = Daemon(nats_server.url, "fl-b")
    peer_b = proxies.add("peer-b", b.address)
    b.extra = ("--advertise", peer_b)
    b.start()
    a = Daemon(nats_server.url, "fl-a").start()
    workers: list[Proc] = []
    try:
        workers.append(start_sim_worker(b.address, "fl0", "--speed", "0.1"))
        wait_ready(b.address, ["fl0"], 60.0)
        routes_to(a.address, "fl0", "fl")
        yield a, b, proxies
    finally:
        for w in workers:
            w.stop()
        a.stop()
        b.stop()
        proxies.close()


def test_a_forwarder_whose_client_left_lets_the_request_run_on_at_the_peer(
    cut_pair: tuple[Daemon, Daemon, ProxySet],
) -> None:
    a, b, proxies = cut_pair
    spec = Spec("fl-1", [21] * 40, MAX_TOKENS)

    async def scenario() -> tuple[bool, list[int], list[int], rpb.Finished | None]:
        proxies.cut(["peer-b"])
        healed = False
        try:
            async with grpc.aio.insecure_channel(a.address) as ch:
                call = request_service_pb2_grpc.RequestServiceStub(ch).Generate(
                    spec.message(detachable=True), timeout=60
                )
                first = asyncio.ensure_future(call.read())
                await asyncio.wait({first}, timeout=2.0)
                answered = first.done()
                call.cancel()  # the client gives up on fl-a (a resumable client's NoAnswer)
            async with grpc.aio.insecure_channel(b.address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                direct = stub.Generate(spec.message(detachable=True), timeout=90)
                msg = await direct.read()
                assert msg.WhichOneof("kind") == "queued", msg
                tokens: list[int] = []
                while len(tokens) < 3:  # running at fl-b, read by its client there
                    r = await direct.read()
                    assert r is not grpc.aio.EOF and r.WhichOneof("kind") == "tokens", r
                    tokens.extend(r.tokens.token_ids)
                before_heal = list(tokens)
                proxies.heal(["peer-b"])
                healed = True
                fin = await read_rest(direct, tokens)
                return answered, before_heal, tokens, fin
        finally:
            if not healed:
                proxies.heal(["peer-b"])

    answered, before_heal, tokens, fin = asyncio.run(asyncio.wait_for(scenario(), 150))
    assert not answered, "fl-a said queued while fl-b, cut off, had not accepted the request"
    assert before_heal, before_heal
    assert fin is not None, "the client's stream at fl-b was taken from it (no Finished)"
    assert fin.reason == common_pb2.FINISH_REASON_LENGTH, fin.message
    assert tokens == sim_expected("fl-1", 40, MAX_TOKENS)  # each token once, all of them
    assert a.proc is not None
    # fl-a's forward did reach fl-b after the heal, and fl-a let the request go.
    deadline = time.monotonic() + 30
    while "request fl-1 runs on at daemon fl-b (its client left)" not in a.output():
        assert time.monotonic() < deadline, a.output()[-3000:]
        time.sleep(0.2)
