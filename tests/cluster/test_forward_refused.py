"""A request forwarded to a peer that refuses it before accepting it (issue 23, found by the
nemesis suite): real daemons on a real nats-server, sim workers, loopback.

- The peer's instance is gone (its worker died) while this daemon still routes to it: the
  request is placed again, without that peer, on the next instance that can take it (here a
  third daemon's, once its worker comes), never ended with an error.
- While it waits for one, it is in this daemon's journal: a kill -9 of this daemon loses
  nothing, the daemon that adopts its journal runs it and the client's Resume finds it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvsched.client import AsyncClient
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.durability.journal import Journal
from kvsched.v1 import common_pb2, journal_pb2
from tests.cluster.durability_kit import (
    Daemon,
    routes_to,
    sim_expected,
    start_sim_worker,
    through,
)
from tests.integration.clients import Outcome, Spec
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)


def _kill(worker: Proc) -> None:
    worker.popen.kill()
    worker.popen.wait(10)


def test_a_request_the_peer_refuses_is_placed_on_another_peer(nats_server: NatsServer) -> None:
    env = {"KVSCHED_REQUEUE_TIMEOUT_S": "20"}
    a = Daemon(nats_server.url, "fa-a", env=env).start()
    b = Daemon(nats_server.url, "fa-b").start()
    c = Daemon(nats_server.url, "fa-c").start()
    workers = [start_sim_worker(b.address, "fa0")]
    try:
        wait_ready(b.address, ["fa0"], 60.0)
        routes_to(a.address, "fa0", "fa")
        _kill(workers[0])  # b refuses what a still forwards to fa0 (for up to ~2 s)
        specs = [Spec(f"fa-{i}", [40 + i] * 30, 24) for i in range(4)]

        async def scenario() -> list[Outcome]:
            sent = asyncio.create_task(through(a.address, specs))
            assert a.proc is not None
            await asyncio.to_thread(a.proc.wait_for, r"forwarded to daemon fa-b: UNAVAILABLE", 30)
            workers.append(start_sim_worker(c.address, "fa1"))  # somewhere to go
            return await sent

        outs = asyncio.run(asyncio.wait_for(scenario(), 120))
        for spec, out in zip(specs, outs, strict=True):
            assert out.code is None, (spec.req_id, out.details)
            assert out.finished is not None
            assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH, out.finished.message
            assert out.tokens == sim_expected(spec.req_id, len(spec.prompt), 24), spec.req_id
        assert a.proc is not None
        a.proc.wait_for(r"forwarded again, to daemon fa-c", timeout=1)
    finally:
        for w in reversed(workers):
            w.stop()
        for d in (a, b, c):
            d.stop()


async def _journaled(url: str, rid: str, within_s: float) -> journal_pb2.JournalRecord | None:
    """The journal's record of `rid`, polled for `within_s` (None: none came)."""
    link = await connect_cluster(url, "fb-probe")
    try:
        journal = Journal(link)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            rec = await journal.lookup(rid)
            if rec is not None:
                return rec
            await asyncio.sleep(0.2)
        return None
    finally:
        await link.close()


async def _resume_across_kill(a: Daemon, b: Daemon, workers: list[Proc]) -> list[int]:
    async with (
        AsyncClient(a.address, options=RESUMABLE_CHANNEL_OPTIONS) as ca,
        AsyncClient(b.address, options=RESUMABLE_CHANNEL_OPTIONS) as cb,
    ):
        s = resumable([ca, cb], [7] * 30, request_id="fb-1", max_tokens=20, retry_for_s=90)
        task = asyncio.create_task(s.read_all())
        assert a.proc is not None
        await asyncio.to_thread(a.proc.wait_for, r"forwarded to daemon fb-b: UNAVAILABLE", 30)
        # Nothing can run it: it waits at a, and a's journal holds it (bounded: 10 s).
        rec = await _journaled(a.nats_url, "fb-1", 10.0)
        assert rec is not None and rec.daemon_id == "fb-a", rec
        assert not task.done()
        a.kill9()
        workers.append(start_sim_worker(b.address, "fb0"))  # b's instance is back
        return await asyncio.wait_for(task, 100)


def test_a_refused_request_waiting_here_is_journaled_and_survives_a_kill(
    nats_server: NatsServer,
) -> None:
    env = {"KVSCHED_MEMBER_TTL_S": "2"}
    a = Daemon(nats_server.url, "fb-a", env=env).start()
    b = Daemon(nats_server.url, "fb-b", env=env).start()
    workers = [start_sim_worker(b.address, "fb0")]
    try:
        wait_ready(b.address, ["fb0"], 60.0)
        routes_to(a.address, "fb0", "fb")
        _kill(workers[0])
        tokens = asyncio.run(_resume_across_kill(a, b, workers))
        assert tokens == sim_expected("fb-1", 30, 20)
        assert b.proc is not None
        b.proc.wait_for(r"kvsched took over 1 request\(s\) of daemon fb-a", timeout=1)
    finally:
        for w in reversed(workers):
            w.stop()
        a.stop()
        b.stop()
