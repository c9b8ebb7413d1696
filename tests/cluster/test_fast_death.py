"""Fast death detection (DESIGN.md section 13): kill -9 of a daemon with the default membership
TTL (6 s). Its worker reaches the survivor, which finds that the dead owner's address refuses
connections (proof of death, unlike a timeout) and takes the lease and the dead daemon's
requests at once by compare-and-set, while the dead daemon's membership entry still exists:
the takeover does not wait for the TTL. Every stream ends with exactly the sim's tokens."""

from __future__ import annotations

import asyncio
import re

import pytest
from nats.js.errors import KeyNotFoundError

from kvsched.client import AsyncClient
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.leases import LEASES_BUCKET
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.membership import MEMBERS_BUCKET
from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import (
    Daemon,
    prompts,
    sim_expected,
    start_sim_worker,
    until_tokens,
)
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)


async def _entries(url: str, iid: str, daemon_id: str) -> tuple[str | None, bool]:
    """(the instance's lease owner, whether `daemon_id` still has a membership entry)."""
    link = await connect_cluster(url, "fd-probe")
    try:
        leases = await link.js.key_value(LEASES_BUCKET)
        members = await link.js.key_value(MEMBERS_BUCKET)
        try:
            owner = ((await leases.get(iid)).value or b"").decode() or None
        except KeyNotFoundError:
            owner = None
        try:
            member = bool((await members.get(daemon_id)).value)
        except KeyNotFoundError:
            member = False
        return owner, member
    finally:
        await link.nc.close()


async def _run(
    a: Daemon, b: Daemon, url: str, requests: list[tuple[str, list[int], int]], w: Proc
) -> tuple[list[list[int]], tuple[str | None, bool]]:
    clients = [AsyncClient(x.address, options=RESUMABLE_CHANNEL_OPTIONS) for x in (a, b)]
    try:
        streams = [
            resumable(clients, p, request_id=rid, max_tokens=n, detachable=True, retry_for_s=90)
            for rid, p, n in requests
        ]
        tasks = [asyncio.create_task(s.read_all()) for s in streams]
        await until_tokens(streams, tasks, 5, "kill", 60)
        a.kill9()
        # The worker is welcomed by the survivor: the lease moved. Read the bucket right then.
        await asyncio.to_thread(
            w.wait_for, r"welcomed by " + re.escape(b.address) + r" as fd0", 60.0
        )
        state = await _entries(url, "fd0", "fd-a")
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return [s.tokens for s in streams], state
    finally:
        for c in clients:
            await c.close()


def test_refused_connection_is_a_death_taken_over_before_the_ttl(
    nats_server: NatsServer,
) -> None:
    a = Daemon(nats_server.url, "fd-a").start()  # default member_ttl_s: 6 s
    b = Daemon(nats_server.url, "fd-b").start()
    workers: list[Proc] = []
    try:
        both = f"{a.address},{b.address}"
        workers.append(start_sim_worker(both, "fd0", "--speed", "0.3", "--reconnect-max-s", "0.5"))
        wait_ready(a.address, ["fd0"], 60.0)
        requests = [(f"fd-{i}", p, 150) for i, p in enumerate(prompts(8, seed=31))]
        got, (owner, member_left) = asyncio.run(
            asyncio.wait_for(_run(a, b, nats_server.url, requests, workers[0]), 200)
        )
        # The survivor owns the instance while the dead daemon's membership entry still exists:
        # the takeover came from the refused connection, not from the TTL.
        assert owner == "fd-b"
        assert member_left, "fd-a's membership entry had expired: the takeover waited the TTL"
        assert b.proc is not None
        b.proc.wait_for(r"daemon fd-a refuses connections at .*: dead; taking over now")
        b.proc.wait_for(r"kvsched took over \d+ request\(s\) of daemon fd-a")
        for (rid, p, n), tokens in zip(requests, got, strict=True):
            assert tokens == sim_expected(rid, len(p), n), rid
    finally:
        for p in reversed(workers):
            p.stop()
        a.stop()
        b.stop()
