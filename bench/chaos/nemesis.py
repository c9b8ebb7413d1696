"""The nemesis: applies a schedule's faults to the cluster, one after another, and ends each
(heal, SIGCONT, restart) after its duration; `heal_all` puts everything back at the end."""

from __future__ import annotations

import asyncio
import signal

from bench.chaos.history import History
from bench.chaos.procs import ChaosCluster
from bench.chaos.schedule import Fault


class Nemesis:
    def __init__(self, cluster: ChaosCluster, history: History) -> None:
        self.c = cluster
        self.history = history
        self.started = 0

    def _links(self, f: Fault) -> list[str]:
        if f.kind == "part_nats":
            return self.c.nats_links(f.target)
        if f.kind == "part_workers":
            return self.c.worker_links(f.target)
        return self.c.peer_links(f.target)

    def begin(self, f: Fault) -> None:
        if f.kind.startswith("part_"):
            self.c.proxies.cut(self._links(f))
        elif f.kind == "pause":
            self.c.daemons[f.target].signal(signal.SIGSTOP)
        elif f.kind == "kill_daemon":
            self.c.kill_daemon(f.target)
        elif f.kind == "kill_worker":
            self.c.workers[f.target].kill9()
        elif f.kind == "kill_nats":
            self.c.kill_nats()
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")

    def end(self, f: Fault) -> None:
        if f.kind.startswith("part_"):
            self.c.proxies.heal(self._links(f))
        elif f.kind == "pause":
            self.c.daemons[f.target].signal(signal.SIGCONT)
        elif f.kind == "kill_daemon":
            self.c.restart_daemon(f.target)
        elif f.kind == "kill_worker":
            self.c.start_worker(f.target)
        elif f.kind == "kill_nats":
            self.c.start_nats()

    async def run(self, faults: list[Fault], until: float) -> None:
        """Each fault at its time (history clock); none starts at or after `until`."""
        for f in faults:
            if f.at_s >= until:
                return
            await asyncio.sleep(max(0.0, f.at_s - self.history.now()))
            self.history.add("fault_start", **f.to_json())
            self.started += 1
            await asyncio.to_thread(self.begin, f)
            await asyncio.sleep(f.duration_s)
            await asyncio.to_thread(self.end, f)
            self.history.add("fault_end", id=f.id)

    def heal_all(self) -> None:
        """Every link healed, every process running (continued or restarted)."""
        names = list(self.c.proxies.names)
        self.c.proxies.heal(names)
        if not self.c.nats.alive():
            self.c.start_nats()
        for k, d in enumerate(self.c.daemons):
            if d.paused:
                d.signal(signal.SIGCONT)
            if not d.alive():
                self.c.restart_daemon(k)
        for w, p in enumerate(self.c.workers):
            if not p.alive():
                self.c.start_worker(w)
