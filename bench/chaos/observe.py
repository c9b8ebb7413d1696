"""What the harness watches while the nemesis works, all written to the history:

- `obs` every 0.5 s: every lease, read from the NATS KV bucket directly (the real server, not
  through a daemon's proxy), and where each instance's worker is attached (each daemon's
  AdminService.GetStatus, `num_ranks_connected > 0`; the same data as `kvsched status`);
- `consumers` every 2 s: JetStream consumers on the server (monitoring port, /jsz);
- `gen_tokens` every 1 s: each daemon's `kvsched_generation_tokens` (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from typing import Any

import grpc
import nats

from bench.chaos.history import History
from bench.chaos.procs import ChaosCluster
from kvsched.cluster.leases import LEASES_BUCKET
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc

GEN_RX = re.compile(r"^kvsched_generation_tokens_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


class Observer:
    def __init__(self, cluster: ChaosCluster, history: History) -> None:
        self.c = cluster
        self.history = history
        self.nc: Any = None
        self.channels = [grpc.aio.insecure_channel(a) for a in cluster.addresses]
        self.stubs = [
            admin_service_pb2_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            for ch in self.channels
        ]
        self.tasks: list[asyncio.Task[None]] = []
        self.last_converged = False

    async def start(self) -> None:
        async def quiet(_: Exception) -> None:
            return None

        self.nc = await nats.connect(
            servers=[f"nats://{self.c.nats_addr}"],
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
            error_cb=quiet,
        )
        loop = asyncio.get_running_loop()
        self.tasks = [
            loop.create_task(self._every(0.5, self.observe)),
            loop.create_task(self._every(2.0, self.sample_consumers)),
            loop.create_task(self._every(1.0, self.sample_gen_tokens)),
        ]

    async def _every(self, period: float, fn: Any) -> None:
        while True:
            with contextlib.suppress(Exception):
                await fn()
            await asyncio.sleep(period)

    async def leases(self) -> dict[str, str | None] | None:
        try:
            kv = await asyncio.wait_for(self.nc.jetstream().key_value(LEASES_BUCKET), 1.0)
            out: dict[str, str | None] = {}
            for iid in self.c.instances:
                try:
                    e = await asyncio.wait_for(kv.get(iid), 1.0)
                    out[iid] = e.value.decode() if e.value else None
                except nats.js.errors.KeyNotFoundError:
                    out[iid] = None
            return out
        except Exception:
            return None

    async def status(self, k: int, timeout: float = 1.0) -> apb.GetStatusResponse | None:
        if not self.c.daemons[k].alive():
            return apb.GetStatusResponse()  # dead: attaches nothing
        try:
            st: apb.GetStatusResponse = await self.stubs[k].GetStatus(
                apb.GetStatusRequest(), timeout=timeout
            )
            return st
        except grpc.aio.AioRpcError:
            return None

    async def observe(self) -> bool:
        leases_t = asyncio.ensure_future(self.leases())
        sts = await asyncio.gather(*(self.status(k) for k in range(len(self.stubs))))
        leases = await leases_t
        attached: dict[str, list[str]] = {i: [] for i in self.c.instances}
        unknown = []
        for k, st in enumerate(sts):
            if st is None:
                unknown.append(self.c.daemon_ids[k])
                continue
            for i in st.instances:
                if i.num_ranks_connected > 0:
                    attached.setdefault(i.instance_id, []).append(self.c.daemon_ids[k])
        self.history.add(
            "obs", leases=leases or {}, attached=attached, unknown=unknown, nats=leases is not None
        )
        ok = (
            leases is not None
            and not unknown
            and all(len(a) == 1 and leases.get(i) == a[0] for i, a in attached.items())
        )
        self.last_converged = ok
        return ok

    def _get(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=1.5) as r:
            return str(r.read().decode())

    async def consumer_detail(self) -> tuple[int, dict[str, int]]:
        """Consumers on the server, and per stream."""
        url = f"http://127.0.0.1:{self.c.nats_mon_port}/jsz?consumers=true"
        body = json.loads(await asyncio.to_thread(self._get, url))
        per = {
            s["name"]: len(s.get("consumer_detail") or [])
            for a in body.get("account_details") or []
            for s in a.get("stream_detail") or []
        }
        return int(body.get("consumers", 0)), per

    async def consumers(self) -> int:
        return (await self.consumer_detail())[0]

    async def sample_consumers(self) -> None:
        n, per = await self.consumer_detail()
        self.history.add("consumers", n=n, by_stream=per)

    async def sample_gen_tokens(self) -> None:
        for k, d in enumerate(self.c.daemons):
            if not d.alive() or d.paused:
                continue
            url = f"http://127.0.0.1:{self.c.metrics_ports[k]}/metrics"
            with contextlib.suppress(Exception):
                body = await asyncio.to_thread(self._get, url)
                v = sum(float(x) for x in GEN_RX.findall(body))
                self.history.add("gen_tokens", daemon=self.c.daemon_ids[k], life=d.lives, v=v)

    async def blocks_held(self) -> tuple[dict[str, dict[str, int]], list[str]]:
        held: dict[str, dict[str, int]] = {}
        missing = []
        for k, did in enumerate(self.c.daemon_ids):
            st = await self.status(k, timeout=5.0)
            if st is None:
                missing.append(did)
                continue
            held[did] = {
                i.instance_id: i.num_gpu_blocks - i.num_free_blocks + i.num_running + i.num_waiting
                for i in st.instances
            }
        return held, missing

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for ch in self.channels:
            await ch.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
