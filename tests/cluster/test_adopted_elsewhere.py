"""Requests held by the old owner of an instance whose lease was taken, and which a peer
adopted from the journal (issue 23, found by the nemesis suite): real daemons, a real
nats-server, sim workers, resumable clients, loopback.

Daemon `ad-a` runs the requests on its only instance; `ad-c` takes it over while `ad-a` lives
(`--take-over`, as a survivor does on a daemon it takes for dead: the instance's lease by CAS,
the requests by the journal's CAS). `ad-a` loses the instance and parks the requests; it must
drop them as adopted elsewhere and cut their streams, so the clients resume at `ad-c` and get
every token, instead of holding them until requeue_timeout_s and ending them with an error."""

from __future__ import annotations

import asyncio

import pytest

from kvsched.client import AsyncClient
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import (
    Daemon,
    prompts,
    routes_to,
    sim_expected,
    start_sim_worker,
    take_lease,
    until_tokens,
)
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)


async def _stream_and_take_over(
    a: Daemon, url: str, requests: list[tuple[str, list[int], int]], daemons: list[Daemon]
) -> list[list[int]]:
    async with AsyncClient(a.address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
        streams = [
            resumable(client, p, request_id=rid, max_tokens=n, retry_for_s=90)
            for rid, p, n in requests
        ]
        tasks = [asyncio.create_task(s.read_all()) for s in streams]
        await until_tokens(streams, tasks, 3, "takeover", 60)
        c = Daemon(url, "ad-c", "--take-over", "ad-a", env={"KVSCHED_REQUEUE_TIMEOUT_S": "60"})
        daemons.append(c)
        await asyncio.to_thread(c.start)
        await asyncio.wait_for(asyncio.gather(*tasks), 100)
        return [s.tokens for s in streams]


def test_requests_adopted_by_a_peer_are_dropped_here_and_resumed_there(
    nats_server: NatsServer,
) -> None:
    env = {"KVSCHED_REQUEUE_TIMEOUT_S": "30"}
    a = Daemon(nats_server.url, "ad-a", env=env).start()
    daemons = [a]
    workers: list[Proc] = []
    try:
        # The worker knows a only: a redirect (the lease taken) sends it to c.
        workers.append(
            start_sim_worker(a.address, "ad0", "--speed", "0.2", "--reconnect-max-s", "0.5")
        )
        wait_ready(a.address, ["ad0"], 60.0)
        requests = [(f"ad-{i}", p, 60) for i, p in enumerate(prompts(4, seed=5))]
        got = asyncio.run(
            asyncio.wait_for(_stream_and_take_over(a, nats_server.url, requests, daemons), 150)
        )
        for (rid, p, n), tokens in zip(requests, got, strict=True):
            assert tokens == sim_expected(rid, len(p), n), rid
        assert a.proc is not None
        a.proc.wait_for(r"instance ad0 taken out: lease taken by daemon ad-c", timeout=1)
        a.proc.wait_for(r"request ad-\d was adopted by another daemon: not continued here", 1)
        assert "no instance could take the request" not in a.output()
    finally:
        for w in workers:
            w.stop()
        for d in reversed(daemons):
            d.stop()


async def _stream_and_take_lease(
    a: Daemon,
    url: str,
    requests: list[tuple[str, list[int], int]],
    lease: tuple[str, str, str],
) -> list[list[int]]:
    """Stream `requests` through `a`; once each has 3 tokens, move a lease by compare-and-set
    (`take_lease(url, *lease)`: new owner, instance, old owner); the streams' tokens."""
    async with AsyncClient(a.address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
        streams = [
            resumable(client, p, request_id=rid, max_tokens=n, retry_for_s=90)
            for rid, p, n in requests
        ]
        tasks = [asyncio.create_task(s.read_all()) for s in streams]
        await until_tokens(streams, tasks, 3, "lease taken", 60)
        await take_lease(url, *lease)
        await asyncio.wait_for(asyncio.gather(*tasks), 100)
        return [s.tokens for s in streams]


def test_requests_still_owned_here_are_handed_to_the_peer_that_took_their_instance(
    nats_server: NatsServer,
) -> None:
    """The lease of `ho-a`'s only instance is taken by `ho-b` (a compare-and-set, as a worker's
    Hello or a takeover pass does) while `ho-a` lives and still owns the requests in the
    journal: no instance here can run them, so `ho-a` hands each to `ho-b` (a Resume asking it
    to adopt the request), which runs it on the instance and streams it back; before, they
    waited at `ho-a` for requeue_timeout_s and ended with an error."""
    env = {"KVSCHED_REQUEUE_TIMEOUT_S": "30"}
    a = Daemon(nats_server.url, "ho-a", env=env).start()
    b = Daemon(nats_server.url, "ho-b", env=env).start()
    workers: list[Proc] = []
    try:
        args = ("--speed", "0.2", "--reconnect-max-s", "0.5")
        workers.append(start_sim_worker(a.address, "ho0", *args))
        wait_ready(a.address, ["ho0"], 60.0)
        requests = [(f"ho-{i}", p, 60) for i, p in enumerate(prompts(4, seed=6))]
        # ho-b takes the lease only: nobody adopts the requests
        got = asyncio.run(
            asyncio.wait_for(
                _stream_and_take_lease(a, nats_server.url, requests, ("ho-b", "ho0", "ho-a")), 150
            )
        )
        for (rid, p, n), tokens in zip(requests, got, strict=True):
            assert tokens == sim_expected(rid, len(p), n), rid
        assert a.proc is not None
        a.proc.wait_for(r"instance ho0 taken out: lease taken by daemon ho-b", timeout=1)
        a.proc.wait_for(r"request ho-\d handed over to daemon ho-b", timeout=1)
        assert "no instance could take the request" not in a.output()
    finally:
        for w in workers:
            w.stop()
        a.stop()
        b.stop()


def test_a_request_handed_back_to_the_daemon_that_forwarded_it_continues_there(
    nats_server: NatsServer,
) -> None:
    """`hc-a` (no instance) forwards the requests to `hc-b`'s instance, whose lease `hc-a`
    then takes: `hc-b` holds them (journaled under it) with no instance and hands them over to
    the instance's new owner, `hc-a`, which still relays them to their clients. `hc-a` must
    adopt them back and run them itself; before, the hand-over's Resume took each request's
    outputs away from its client's stream, which ended without a Finished."""
    a = Daemon(nats_server.url, "hc-a").start()
    b = Daemon(nats_server.url, "hc-b").start()
    workers: list[Proc] = []
    try:
        args = ("--speed", "0.2", "--reconnect-max-s", "0.5")
        workers.append(start_sim_worker(b.address, "hc0", *args))
        wait_ready(b.address, ["hc0"], 60.0)
        routes_to(a.address, "hc0", "hc")
        requests = [(f"hc-{i}", p, 60) for i, p in enumerate(prompts(3, seed=8))]
        got = asyncio.run(
            asyncio.wait_for(
                _stream_and_take_lease(a, nats_server.url, requests, ("hc-a", "hc0", "hc-b")), 150
            )
        )
        for (rid, p, n), tokens in zip(requests, got, strict=True):
            assert tokens == sim_expected(rid, len(p), n), rid
        assert b.proc is not None
        b.proc.wait_for(r"instance hc0 taken out: lease taken by daemon hc-a", timeout=1)
        b.proc.wait_for(r"continues at the daemon that accepted it", timeout=1)
    finally:
        for w in workers:
            w.stop()
        a.stop()
        b.stop()
