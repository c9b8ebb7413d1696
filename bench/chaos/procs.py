"""The cluster under test, as real processes on loopback, wired through the harness's proxies.

- a nats-server with JetStream and its monitoring port (`-m`, for /jsz), fixed ports and store
  folder, so a kill -9 and restart keeps both;
- 3 `kvsched serve --cluster` daemons on fixed ports; each reaches NATS through its own proxy
  (`nats-dK`: the daemon-NATS link) and advertises a proxy in front of itself (`peer-dK`: what
  the other daemons, and workers they redirect, use: the daemon-daemon link);
- 6 `kvsched worker --executor sim` workers (instance `cW`, home daemon W // 2); worker W lists
  every daemon through its own proxies (`wW-dK`: the daemon-worker links), its home first.

Clients talk to the daemons' own ports (no proxy: the client-daemon link is not faulted).
Every process writes its output to a log file in the run folder; `Proc.wait_for` reads it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.chaos.proxy import ProxySet, free_port
from kvsched.cluster.natsd import find_nats_server

REPO = Path(__file__).resolve().parents[2]


class Proc:
    """A child process whose output goes to a log file; restartable with the same command."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.offset = 0  # where the current life's output starts in the log
        self.lives = 0
        self.paused = False

    def start(self) -> Proc:
        with open(self.log_path, "ab") as f:
            self.offset = f.tell()
            f.write(f"==== start {self.lives} at {time.time():.3f}\n".encode())
            self.offset = f.tell()
            self.popen = subprocess.Popen(
                self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=REPO
            )
        self.lives += 1
        self.paused = False
        return self

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            if m := rx.search(self.output()):
                return m
            if self.popen is None or self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.output()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no {pattern!r} in {timeout} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(sig)
            self.paused = sig == signal.SIGSTOP or (self.paused and sig != signal.SIGCONT)

    def kill9(self) -> None:
        if self.popen is not None:
            self.popen.kill()
            self.popen.wait(10)
        self.paused = False

    def stop(self, timeout: float = 15.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        if self.paused:
            self.popen.send_signal(signal.SIGCONT)
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class ChaosCluster:
    def __init__(
        self,
        run_dir: Path,
        ttl_s: float,
        num_daemons: int = 3,
        num_workers: int = 6,
        worker_speed: float = 0.3,
    ) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ttl_s = ttl_s
        self.proxies = ProxySet()
        self.nats_port, self.nats_mon_port = free_port(), free_port()
        self.nats_addr = f"127.0.0.1:{self.nats_port}"
        store = run_dir / "nats-store"
        nats_argv = [find_nats_server(), "--jetstream", "--store_dir", str(store)]
        nats_argv += ["--addr", "127.0.0.1", "--port", str(self.nats_port)]
        nats_argv += ["-m", str(self.nats_mon_port)]
        self.nats = Proc("nats", nats_argv, run_dir, dict(os.environ))
        self.daemon_ids = [f"d{k}" for k in range(num_daemons)]
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_daemons)]
        self.metrics_ports = [free_port() for _ in range(num_daemons)]
        self.instances = [f"c{w}" for w in range(num_workers)]
        self.home = [w * num_daemons // num_workers for w in range(num_workers)]
        env = child_env(
            {
                "KVSCHED_MEMBER_TTL_S": str(ttl_s),
                "KVSCHED_JOURNAL_FLUSH_MS": "50",
                "KVSCHED_GRACE_PERIOD_S": "1",
            }
        )
        py = [sys.executable, "-m", "kvsched.cli"]
        self.daemons: list[Proc] = []
        for k, did in enumerate(self.daemon_ids):
            nats_url = "nats://" + self.proxies.add(f"nats-{did}", self.nats_addr)
            adv = self.proxies.add(f"peer-{did}", self.addresses[k])
            argv = py + ["serve", "--listen", self.addresses[k], "--log-level", "info"]
            argv += ["--metrics-listen", f"127.0.0.1:{self.metrics_ports[k]}"]
            argv += ["--cluster", nats_url, "--daemon-id", did, "--advertise", adv]
            self.daemons.append(Proc(f"daemon-{did}", argv, run_dir, env))
        self.workers: list[Proc] = []
        for w, iid in enumerate(self.instances):
            order = [(self.home[w] + j) % num_daemons for j in range(num_daemons)]
            servers = [self.proxies.add(f"w{w}-d{k}", self.addresses[k]) for k in order]
            argv = py + ["worker", "--executor", "sim", "--instance", iid]
            argv += ["--server", ",".join(servers), "--speed", str(worker_speed)]
            argv += ["--reconnect-max-s", "0.5"]
            self.workers.append(Proc(f"worker-{iid}", argv, run_dir, env))

    # ---- links (the proxies' names) -------------------------------------------------------------

    def nats_links(self, k: int) -> list[str]:
        return [f"nats-{self.daemon_ids[k]}"]

    def peer_links(self, k: int) -> list[str]:
        return [f"peer-{self.daemon_ids[k]}"]

    def worker_links(self, k: int) -> list[str]:
        return [f"w{w}-d{k}" for w in range(len(self.workers))]

    # ---- life -----------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> None:
        self.start_nats()
        for d in self.daemons:
            d.start()
        for d in self.daemons:
            d.wait_for(r"kvsched listening on", timeout_s)
        for w in range(len(self.workers)):
            self.start_worker(w)

    def start_worker(self, w: int) -> None:
        self.workers[w].start()
        self.proxies.pids(
            {f"w{j}": p.popen.pid for j, p in enumerate(self.workers) if p.popen is not None}
        )

    def start_nats(self) -> None:
        self.nats.start()
        self.nats.wait_for(r"Server is ready", 30)
        self.proxies.up(self.nats_addr)

    def restart_daemon(self, k: int, timeout_s: float = 60.0) -> None:
        self.daemons[k].start()
        self.daemons[k].wait_for(r"kvsched listening on", timeout_s)
        self.proxies.up(self.addresses[k])

    def kill_daemon(self, k: int) -> None:
        self.daemons[k].kill9()
        self.proxies.down(self.addresses[k])

    def kill_nats(self) -> None:
        self.nats.kill9()
        self.proxies.down(self.nats_addr)

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop everything (workers first); per worker the tokens its lives that ended cleanly
        sampled (`worker stats` lines: a life ended by kill -9 writes none) and its lives."""
        tokens: dict[str, dict[str, int]] = {}
        for w, iid in zip(self.workers, self.instances, strict=True):
            w.stop()
            found = re.findall(r"worker stats: \d+ steps, (\d+) tokens", w.log_path.read_text())
            tokens[iid] = {"tokens": sum(map(int, found)), "lives": w.lives, "stats": len(found)}
        for d in self.daemons:
            d.stop()
        self.nats.stop()
        self.proxies.close()
        return tokens
