"""What the heal / partition tests share: a nats-server with its monitoring port (consumers and
subscriptions counted from /jsz and /connz), bucket reads, and resumable load over daemons."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import KeyNotFoundError

from kvsched.client import AsyncClient
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, ResumableStream, resumable
from kvsched.cluster.leases import LEASES_BUCKET
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer, free_port
from tests.integration.harness import status


class MonitoredNats(NatsServer):
    """A NatsServer with its HTTP monitoring port open (loopback)."""

    def __init__(self) -> None:
        super().__init__()
        self.monitor_port = free_port()

    def command(self) -> list[str]:
        return [*super().command(), "-m", str(self.monitor_port)]

    def _get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)

    def consumers(self) -> int:
        """JetStream consumers on the server now (every stream, every kind)."""
        return int(self._get("/jsz")["consumers"])

    def subscriptions(self, name: str) -> int:
        """Subscriptions held by the client connection(s) named `name` (kvsched-<daemon id>)."""
        conns = self._get("/connz?subs=1&limit=1024")["connections"] or []
        return sum(int(c.get("subscriptions", 0)) for c in conns if c.get("name") == name)

    def connections(self, name: str) -> int:
        conns = self._get("/connz?limit=1024")["connections"] or []
        return sum(1 for c in conns if c.get("name") == name)


async def lease_owners(url: str, iids: list[str]) -> dict[str, str | None]:
    link = await connect_cluster(url, "heal-probe")
    try:
        kv = await link.js.key_value(LEASES_BUCKET)
        out: dict[str, str | None] = {}
        for iid in iids:
            try:
                out[iid] = ((await kv.get(iid)).value or b"").decode() or None
            except KeyNotFoundError:
                out[iid] = None
        return out
    finally:
        await link.nc.close()


def attached(addresses: dict[str, str]) -> dict[str, set[str]]:
    """daemon id -> the instances attached (ready) there now."""
    return {
        d: {i.instance_id for i in status(a).instances if i.ready} for d, a in addresses.items()
    }


def converged(url: str, addresses: dict[str, str], iids: list[str]) -> bool:
    """Every instance attached at exactly one daemon, the one its lease names."""
    owners = asyncio.run(lease_owners(url, iids))
    where = attached(addresses)
    for iid in iids:
        at = [d for d, got in where.items() if iid in got]
        if at != [owners[iid]]:
            return False
    return True


@dataclass
class Load:
    """Resumable streams over every daemon (each request submitted through `first`)."""

    streams: list[ResumableStream] = field(default_factory=list)
    tasks: list[asyncio.Task[list[int]]] = field(default_factory=list)
    gaps: list[list[tuple[float, float]]] = field(default_factory=list)
    clients: list[AsyncClient] = field(default_factory=list)

    async def start(
        self, addresses: list[str], requests: list[tuple[str, list[int], int, int]]
    ) -> None:
        """requests: (id, prompt, max_tokens, index of the daemon to submit through)."""
        self.clients = [AsyncClient(a, options=RESUMABLE_CHANNEL_OPTIONS) for a in addresses]
        n = len(self.clients)
        for rid, prompt, max_tokens, first in requests:
            order = [self.clients[(first + k) % n] for k in range(n)]
            s = resumable(order, prompt, request_id=rid, max_tokens=max_tokens, retry_for_s=120)
            self.streams.append(s)
            self.gaps.append([])
            self.tasks.append(asyncio.create_task(self._read(s, self.gaps[-1])))

    @staticmethod
    async def _read(s: ResumableStream, gaps: list[tuple[float, float]]) -> list[int]:
        """Read `s` to its end; `gaps` gets (when, seconds) of every wait between batches."""
        last = time.monotonic()
        async for _ in s:
            now = time.monotonic()
            gaps.append((last, now - last))
            last = now
        return s.tokens

    def stalls_after(self, t0: float, indexes: list[int]) -> list[float]:
        """For each stream in `indexes`: seconds from `t0` to its first batch after `t0`."""
        out = []
        for i in indexes:
            after = [start + gap for start, gap in self.gaps[i] if start + gap >= t0]
            if after:
                out.append(min(after) - t0)
        return out

    async def wait_tokens(self, at_least: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(len(s.tokens) < at_least for s in self.streams):
            assert time.monotonic() < deadline, "the load never reached its start point"
            assert not any(t.done() for t in self.tasks), "a stream ended early"
            await asyncio.sleep(0.02)

    async def finish(self, timeout_s: float = 120.0) -> list[BaseException]:
        try:
            got = await asyncio.wait_for(
                asyncio.gather(*self.tasks, return_exceptions=True), timeout_s
            )
        except TimeoutError:
            for s in self.streams:  # where each one stood, for the failure's report
                print(
                    f"{s.request_id}: {len(s.tokens)} tokens, {s.resumes} resumes, breaks at "
                    f"{[round(b, 1) for b in s.broken_at]}, finished {s.finished}"
                )
            raise
        for c in self.clients:
            await c.close()
        return [g for g in got if isinstance(g, BaseException)]
