"""A real nats-server with JetStream on a loopback port, one per test module; a cluster of real
daemons and sim workers on it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvsched.cluster.natsd import NatsServer
from tests.integration.harness import Proc, start_daemon, start_worker, status, wait_ready


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@dataclass
class Cluster:
    daemons: list[Proc] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for p in reversed(self.workers + self.daemons):
            p.stop()


def start_cluster(
    url: str,
    prefix: str,
    num_daemons: int,
    workers_per_daemon: int,
    worker_args: tuple[str, ...] = ("--zero-cost",),
    daemon_args: tuple[str, ...] = (),
    daemon_env: dict[str, str] | None = None,
) -> Cluster:
    """Daemons {prefix}-d0.. and workers {prefix}k (instance k attached to daemon
    k // workers_per_daemon); waits until every daemon's routing knows every instance."""
    c = Cluster()
    try:
        for d in range(num_daemons):
            proc, addr = start_daemon(
                "--cluster", url, "--daemon-id", f"{prefix}-d{d}", *daemon_args, env=daemon_env
            )
            c.daemons.append(proc)
            c.addresses.append(addr)
        k = 0
        for d in range(num_daemons):
            for _ in range(workers_per_daemon):
                c.workers.append(start_worker(c.addresses[d], f"{prefix}{k}", *worker_args))
                k += 1
        for d in range(num_daemons):
            wait_ready(
                c.addresses[d],
                [f"{prefix}{d * workers_per_daemon + j}" for j in range(workers_per_daemon)],
            )
        want = {f"{prefix}{j}" for j in range(k)}
        deadline = time.monotonic() + 30
        for addr in c.addresses:
            while True:
                known = {i.instance_id for i in status(addr).cluster.instances if i.load_known}
                if want <= known:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{addr} knows only {sorted(known)} of the cluster")
                time.sleep(0.1)
    except BaseException:
        c.stop()
        raise
    return c
