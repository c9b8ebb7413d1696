"""Start a daemon and simulated workers as child processes, the way a user would run them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and seen == len(self.lines)):
                    tail = "\n".join(self.lines[-30:])
                    raise RuntimeError(f"{self.name}: no line matching {pattern!r}:\n{tail}")
                self._cond.wait(min(left, 0.5))

    def stop(self, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(5)


def spawn(name: str, *args: str) -> Child:
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvsched.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    child = Child(name, popen)
    threading.Thread(target=child.pump, daemon=True).start()
    return child


@dataclass
class Cluster:
    """Daemons (one, or several on a local NATS) and their simulated workers, started together
    and stopped together. `address`: the daemons' addresses, comma-separated."""

    daemons: list[Child]
    address: str
    workers: list[Child]
    nats: Any = None  # kvsched.cluster.natsd.NatsServer when there are several daemons

    def stop(self) -> dict[str, float]:
        """Stop workers then the daemons; return each worker's idle_frac_control_plane."""
        idle: dict[str, float] = {}
        for w in self.workers:
            w.stop()
            for line in reversed(w.lines):
                if m := re.search(r"idle_frac_control_plane ([0-9.]+)", line):
                    idle[w.name] = float(m.group(1))
                    break
        for d in self.daemons:
            d.stop()
        if self.nats is not None:
            self.nats.close()
        return idle


def start_daemon(*serve_args: str) -> tuple[Child, str]:
    """`kvsched serve` on a free loopback port (metrics off, warnings only); its address."""
    daemon = spawn(
        "daemon", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off",
        "--log-level", "warning", *serve_args,
    )  # fmt: skip
    return daemon, daemon.wait_for(r"kvsched listening on (\S+:\d+)").group(1)


def start_cluster(
    num_workers: int,
    *,
    gpu: str = "h100",
    speed: float = 1.0,
    num_blocks: int = 5120,
    block_size: int = 64,
    num_slots: int = 256,
    host_blocks: int = 0,
    serve_args: tuple[str, ...] = (),
    num_daemons: int = 1,
) -> Cluster:
    """`num_daemons` > 1: a local nats-server and that many daemons in one cluster; worker i
    is given every daemon, daemon i % num_daemons first."""
    nats = None
    daemons, addresses = [], []
    try:
        if num_daemons > 1:
            from kvsched.cluster.natsd import NatsServer

            nats = NatsServer().start()
        for k in range(num_daemons):
            cluster_args = () if nats is None else ("--cluster", nats.url, "--daemon-id", f"d{k}")
            daemon, address = start_daemon(*serve_args, *cluster_args)
            daemons.append(daemon)
            addresses.append(address)
    except BaseException:
        for d in daemons:
            d.stop()
        if nats is not None:
            nats.close()
        raise
    n = len(addresses)
    servers = [",".join(addresses[i % n :] + addresses[: i % n]) for i in range(num_workers)]
    workers: list[Child] = []
    try:
        _start_workers(workers, servers, gpu, speed, num_blocks, block_size, num_slots, host_blocks)
    except BaseException:  # a worker that never joins: stop what was started, then raise
        Cluster(daemons, ",".join(addresses), workers, nats).stop()
        raise
    return Cluster(daemons, ",".join(addresses), workers, nats)


def _start_workers(
    workers: list[Child],
    servers: list[str],
    gpu: str,
    speed: float,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    host_blocks: int,
) -> None:
    """Sim worker i on servers[i], appended to `workers` as it starts; returns once every one
    was welcomed."""
    for i, server in enumerate(servers):
        args = (
            "worker", "--server", server, "--instance", f"w{i}", "--executor", "sim",
            "--gpu", gpu, "--speed", str(speed), "--num-blocks", str(num_blocks),
            "--block-size", str(block_size), "--num-slots", str(num_slots),
            "--host-blocks", str(host_blocks),
        )  # fmt: skip
        workers.append(spawn(f"w{i}", *args))
    for w in workers:
        w.wait_for(r"welcomed")
