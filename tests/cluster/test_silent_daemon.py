"""A paused daemon does not hold its workers (Welcome.silence_timeout_ns): a real `kvsched serve`
stopped with SIGSTOP while its worker streams; the worker leaves it once it has heard nothing for
the bound, and once the paused daemon's membership expires the survivor owns the instance; after
SIGCONT the ownership stays converged (the instance attached where its lease is)."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest
from nats.js.errors import KeyNotFoundError

from kvsched.cluster.leases import LEASES_BUCKET
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import Daemon, start_sim_worker
from tests.integration.harness import Proc, status, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

# heartbeats every 0.5 s, a worker leaves after 4 silent intervals (2 s); membership TTL 2 s
ENV = {
    "KVSCHED_MEMBER_TTL_S": "2",
    "KVSCHED_HEARTBEAT_INTERVAL_S": "0.5",
    "KVSCHED_HEARTBEAT_TIMEOUT_S": "3",
    "KVSCHED_SILENCE_TIMEOUT_INTERVALS": "4",
}


def _ready(address: str) -> dict[str, bool]:
    return {i.instance_id: i.ready for i in status(address).instances}


async def _lease_owner(url: str, iid: str) -> str | None:
    """The lease's owner as the bucket has it now (one read; no watcher)."""
    link = await connect_cluster(url, "sd-probe")
    try:
        kv = await link.js.key_value(LEASES_BUCKET)
        try:
            entry = await kv.get(iid)
        except KeyNotFoundError:
            return None
        return (entry.value or b"").decode() or None
    finally:
        await link.nc.close()


def test_worker_leaves_a_paused_daemon_within_its_silence_bound(nats_server: NatsServer) -> None:
    a = Daemon(nats_server.url, "sd-a", env=ENV).start()
    b = Daemon(nats_server.url, "sd-b", env=ENV).start()
    workers: list[Proc] = []
    try:
        both = f"{a.address},{b.address}"
        workers.append(start_sim_worker(both, "sd0", "--speed", "0.3", "--reconnect-max-s", "0.5"))
        w = workers[0]
        wait_ready(a.address, ["sd0"], 60.0)
        welcome = w.wait_for(r"welcomed by " + re.escape(a.address))
        assert asyncio.run(_lease_owner(nats_server.url, "sd0")) == "sd-a"
        assert a.proc is not None
        a.proc.signal(signal.SIGSTOP)
        try:
            # The worker hears nothing more from sd-a: it leaves once the bound (2 s) passed.
            left = w.wait_after(
                welcome.string,
                rf"leaving daemon {re.escape(a.address)}: no anything from it for ([\d.]+) s "
                r"\(bound 2 s",
                timeout=30,
            )
            assert float(left.group(1)) >= 2.0
            # sd-b redirects it to the lease owner while sd-a's membership lives (a pause is
            # not a death); once it expires, sd-b owns the instance and welcomes the worker.
            w.wait_after(left.string, r"welcomed by " + re.escape(b.address), timeout=60)
            wait_ready(b.address, ["sd0"], 30.0)
            assert asyncio.run(_lease_owner(nats_server.url, "sd0")) == "sd-b"
        finally:
            a.proc.signal(signal.SIGCONT)
        # After it continues, sd-a does not take the instance back: it stays where its lease is.
        deadline = time.monotonic() + 20
        while _ready(a.address).get("sd0") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _ready(a.address).get("sd0")
        time.sleep(3)  # a few of sd-a's lease/view passes after the pause
        assert _ready(b.address).get("sd0")
        assert not _ready(a.address).get("sd0")
        assert asyncio.run(_lease_owner(nats_server.url, "sd0")) == "sd-b"
    finally:
        for p in reversed(workers):
            p.stop()
        a.stop()
        b.stop()
