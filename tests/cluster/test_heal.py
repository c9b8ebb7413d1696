"""Heal after NATS outages (issue 23): one daemon reaches NATS through a TCP proxy the test owns;
the proxy drops every connection and refuses new ones 100 times (each cut shorter than the
membership TTL). After every reconnect the daemon's link, its leases watcher and its polls come
back without leaking: the server's JetStream consumers and the daemon's subscriptions stay
bounded (counted on the server's monitoring port), its membership view holds itself, its lease
is still its own (a cut shorter than the TTL never causes a takeover), and it serves requests."""

from __future__ import annotations

import time

import pytest

from kvsched.client import Client
from tests.cluster.durability_kit import Daemon, sim_expected, start_sim_worker
from tests.cluster.heal_kit import MonitoredNats, lease_owners
from tests.cluster.tcp_proxy import TcpProxy
from tests.integration.harness import Proc, status, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

CYCLES = 100
BUDGET_S = 240.0  # the cycles stop here even if fewer than CYCLES ran (asserted below)


def _connected_again(d: Daemon, proxy: TcpProxy, before: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proxy.num_connections > before and status(d.address).cluster.connected:
            return
        time.sleep(0.02)
    raise AssertionError("the daemon did not reconnect to NATS")


@pytest.mark.slow
def test_hundred_reconnects_leak_no_consumers_or_subscriptions() -> None:
    import asyncio

    nats = MonitoredNats().start()
    proxy = TcpProxy("127.0.0.1", nats.port).start()
    d = Daemon(proxy.url, "hl-d0").start()  # default TTL 6 s: every cut is far shorter
    workers: list[Proc] = []
    try:
        workers.append(start_sim_worker(d.address, "hl0", "--zero-cost"))
        wait_ready(d.address, ["hl0"], 60.0)
        time.sleep(1.0)  # its first polls and watchers are up
        base_consumers = nats.consumers()
        base_subs = nats.subscriptions("kvsched-hl-d0")
        assert base_subs > 0
        peak_consumers, peak_subs = base_consumers, base_subs
        t0 = time.monotonic()
        cycles = 0
        while cycles < CYCLES and time.monotonic() - t0 < BUDGET_S:
            before = proxy.num_connections
            proxy.cut()
            time.sleep(0.05)
            proxy.heal()
            _connected_again(d, proxy, before, time.monotonic() + 20)
            cycles += 1
            if cycles % 10 == 0:
                time.sleep(0.5)  # a poll and a watcher restart land between cuts
                peak_consumers = max(peak_consumers, nats.consumers())
                peak_subs = max(peak_subs, nats.subscriptions("kvsched-hl-d0"))
        elapsed = time.monotonic() - t0
        time.sleep(3.0)  # settle: the last watcher restarted, old consumers deleted
        end_consumers = nats.consumers()
        end_subs = nats.subscriptions("kvsched-hl-d0")
        print(
            f"\n{cycles} reconnects in {elapsed:.1f} s: consumers {base_consumers} -> peak "
            f"{peak_consumers} -> {end_consumers}; subscriptions {base_subs} -> peak {peak_subs}"
            f" -> {end_subs}; connections {nats.connections('kvsched-hl-d0')}"
        )
        assert cycles == CYCLES, f"only {cycles} reconnects within {BUDGET_S:g} s"
        # Bounded: what a reconnect leaves behind is gone once it settled (a watcher replaced
        # while its predecessor's delete was in flight may count once), not one per reconnect.
        assert end_consumers <= base_consumers + 1, (base_consumers, end_consumers)
        assert peak_consumers <= base_consumers + 3, (base_consumers, peak_consumers)
        assert end_subs <= base_subs + 1, (base_subs, end_subs)
        assert nats.connections("kvsched-hl-d0") == 1
        # Its view is right: itself alive, its lease its own (no cut outlived the TTL).
        c = status(d.address).cluster
        assert c.connected
        assert [m.daemon_id for m in c.daemons] == ["hl-d0"]
        assert asyncio.run(lease_owners(nats.url, ["hl0"])) == {"hl0": "hl-d0"}
        assert "self-fenced" not in d.output()
        with Client(d.address) as client:
            prompt = list(range(3, 40))
            got = client.generate(prompt, request_id="hl-after", max_tokens=8)
            assert got.tokens() == sim_expected("hl-after", len(prompt), 8)
    finally:
        for p in workers:
            p.stop()
        d.stop()
        proxy.close()
        nats.close()
