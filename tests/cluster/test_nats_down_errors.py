"""With NATS down, refusals say why (issue 24): a daemon without workers of its own, whose peer
has them, answers that the cluster is unreachable naming NATS and the cause (not "no worker
connected"); a daemon with workers refuses a journaled request saying its journal is
unreachable (not "did not store the request within 2 s" after 0.00 s). Real nats-server,
daemons and a sim worker."""

from __future__ import annotations

import tempfile
import time

import pytest

from kvsched.client import Client, Unavailable
from kvsched.cluster.natsd import NatsServer
from tests.integration.harness import start_daemon, start_worker, status, wait_ready


def _wait(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_refusals_with_nats_down_name_the_cause() -> None:
    nats = NatsServer(store_dir=tempfile.mkdtemp(prefix="kvsched-nats-down-")).start()
    procs = []
    try:
        d0, a0 = start_daemon("--cluster", nats.url, "--daemon-id", "nd-d0")
        procs.append(d0)
        d1, a1 = start_daemon("--cluster", nats.url, "--daemon-id", "nd-d1")
        procs.append(d1)
        worker = start_worker(a0, "nd0", "--zero-cost")
        procs.insert(0, worker)
        wait_ready(a0, ["nd0"])

        def peers_ready() -> bool:
            with Client(a1, timeout=5) as c:
                return any(m.ready_instances for m in c.list_models())

        _wait(peers_ready, "d1 to route to d0's instance")
        with Client(a1, timeout=30) as c:  # forwarded to d0's instance while NATS is up
            assert len(c.generate([1, 2, 3], max_tokens=3).tokens()) == 3
        nats.stop()
        _wait(lambda: not status(a1).cluster.connected, "d1 to see NATS down")
        _wait(lambda: not status(a0).cluster.connected, "d0 to see NATS down")

        with Client(a1, timeout=30) as c, pytest.raises(Unavailable) as e:
            c.generate([1, 2, 3], max_tokens=3)
        msg = e.value.message
        assert "cluster is unreachable" in msg and nats.url in msg, msg
        assert "nd-d0" in msg  # the peer whose instances it cannot reach
        assert not msg.startswith("no instance is ready"), msg

        with Client(a0, timeout=30) as c, pytest.raises(Unavailable) as e:
            c.generate([1, 2, 3], max_tokens=3)
        msg = e.value.message
        assert "journal" in msg and "unreachable" in msg and "within" not in msg, msg
    finally:
        for p in procs:
            p.stop()
        nats.stop()
