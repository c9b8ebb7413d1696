"""Fleet benchmark: one daemon driving many sim instances, then two daemons sharing them.

    python -m bench.fleet [--instances 8,16,32] [--two-daemons 32] [--seconds 8]
                          [--per-instance 8] [--json bench/results/fleet.json]

Each case starts, as child processes, the daemon(s) (`kvsched serve`; with two, a local NATS and
`--cluster`) and ONE worker host: a process running N reference workers (`Worker`, sim executor,
H100 cost fit at `--speed` 0.5: decode steps of ~10-15 ms) on one asyncio loop, each its own
instance and its own Connect stream. This process is the front end: one Session per daemon,
keeping `--per-instance` x N requests running (256-token prompts from 16 shared prefixes plus a
distinct tail, 64 output tokens, a new request whenever one finishes, spread round-robin over
the daemons). After a warm-up, one window of `--seconds` is measured:

    instance_steps_per_s   worker steps (all instances) / window
    daemon_cpu_us_per_step each daemon's utime + stime over the window / instance steps (with two
                           daemons: their sum, and each daemon's share)
    idle_frac_control_plane  of the time a worker held work, the fraction it sat idle waiting on
                           the daemon (WorkerStats), over the window, the worst instance and the
                           mean (target <= 1 % at 32 instances)
    route_us_p50 / p99     the cluster-wide routing decision per request (ClusterStatus)
    forwarded_share        requests a daemon forwarded to its peer's instance / requests
    cpu_us_per_token       all daemons' CPU / tokens delivered to the front end; the two-daemon
                           case minus the one-daemon case at the same N is the forwarding
                           overhead per token (relay through a second daemon)

`--worker-host` is the worker host's own entry (the bench starts it). Everything shares the
machine's cores: the figures are bounded by the sum of the processes' CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.transport_stack import cpu_s, machine_busy_s, spawn
from kvsched.client import AsyncClient, AsyncSession

DEFAULT_JSON = Path(__file__).parent / "results" / "fleet.json"
PROMPT_PREFIX = 240
NUM_PREFIXES = 16
MAX_TOKENS = 64
NUM_BLOCKS = 4096
BLOCK_SIZE = 16


# ---- the worker host (a child process) -------------------------------------------------------


async def _worker_host(
    servers: list[str], count: int, prefix: str, slots: int, speed: float
) -> None:
    from kvsched.worker_stub.client import Worker, sim_engine_factory

    workers = []
    for i in range(count):
        order = servers[i % len(servers) :] + servers[: i % len(servers)]
        workers.append(
            Worker(
                ",".join(order),
                f"{prefix}{i}",
                sim_engine_factory(slots, gpu="h100", speed=speed),
                num_gpu_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                num_slots=slots,
            )
        )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [w.stop() for w in workers])
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        totals = {
            "steps": sum(w.stats.num_steps for w in workers),
            "busy": [w.stats.busy_s for w in workers],
            "wait": [w.stats.idle_waiting_on_daemon_s for w in workers],
            "connected": sum(1 for w in workers if w.stats.num_connects > 0),
        }
        print("FLEET " + json.dumps(totals), flush=True)


# ---- the front end ------------------------------------------------------------------------------


class FrontEnd:
    def __init__(self, addresses: list[str], running: int, seed: int = 0) -> None:
        self.addresses = addresses
        self.running = running
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(3, 30000) for _ in range(PROMPT_PREFIX)]
            for _ in range(NUM_PREFIXES)
        ]
        self.n = 0
        self.tokens = 0
        self.finished = 0
        self.stop = False

    async def run(self) -> None:
        async with AsyncClient(self.addresses[0]) as c0:
            clients = [c0] + [AsyncClient(a) for a in self.addresses[1:]]
            for c in clients[1:]:
                await c.__aenter__()
            try:
                sessions = [c.session() for c in clients]
                per = -(-self.running // len(sessions))
                await asyncio.gather(*(self._drive(s, per) for s in sessions))
            finally:
                for c in clients[1:]:
                    await c.__aexit__(None, None, None)

    async def _submit(self, session: AsyncSession) -> None:
        self.n += 1
        prompt = self.prefixes[self.n % NUM_PREFIXES] + [
            self.rng.randrange(3, 30000) for _ in range(16)
        ]
        await session.submit(
            prompt, request_id=f"f{self.n}", max_tokens=MAX_TOKENS, ignore_eos=True
        )

    async def _drive(self, session: AsyncSession, keep: int) -> None:
        for _ in range(keep):
            await self._submit(session)
        async for batch in session:
            self.tokens += sum(n for _, n in batch.token_counts())
            done = len(batch.finished)
            self.finished += done
            if self.stop:
                if done:
                    continue
                break
            for _ in range(done):
                await self._submit(session)
        session.cancel()


# ---- one case -----------------------------------------------------------------------------------


def _last_fleet(child: Any) -> dict[str, Any] | None:
    for line in reversed(child.lines):
        if line.startswith("FLEET "):
            return dict(json.loads(line[6:]))
    return None


async def _status(addr: str) -> Any:
    async with AsyncClient(addr) as c:
        return await c.status(timeout=10)


def run_case(
    num: int, daemons: int, seconds: float, per_instance: int, speed: float
) -> dict[str, Any]:
    from kvsched.cluster.natsd import NatsServer

    nats = NatsServer().start() if daemons > 1 else None
    procs: list[Any] = []
    try:
        addrs = []
        for k in range(daemons):
            args = ["-m", "kvsched.cli", "serve", "--listen", "127.0.0.1:0"]
            args += ["--metrics-listen", "off", "--log-level", "warning"]
            if nats is not None:
                args += ["--cluster", nats.url, "--daemon-id", f"fleet-d{k}"]
            d = spawn(f"daemon{k}", args, {})
            procs.append(d)
            addrs.append(d.wait_for(r"kvsched listening on (\S+:\d+)").group(1))
        host = spawn(
            "workers",
            ["-m", "bench.fleet", "--worker-host", "--servers", ",".join(addrs),
             "--count", str(num), "--slots", str(max(16, 2 * per_instance)),
             "--speed", str(speed)],
            {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        procs.append(host)
        deadline = time.monotonic() + 60
        while (st := _last_fleet(host)) is None or st["connected"] < num:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not connect: {host.lines[-20:]}")
            time.sleep(0.2)
        time.sleep(1.5 if daemons > 1 else 0.5)  # KV events and load reach every daemon
        fe = FrontEnd(addrs, per_instance * num)
        return asyncio.run(_measure(fe, addrs, procs[:daemons], host, seconds))
    finally:
        for p in reversed(procs):
            p.stop()
        if nats is not None:
            nats.close()


async def _measure(
    fe: FrontEnd, addrs: list[str], daemons: list[Any], host: Any, seconds: float
) -> dict[str, Any]:
    front = asyncio.ensure_future(fe.run())
    await asyncio.sleep(3.0)  # warm-up: every request running, caches filled
    c0 = [cpu_s(d.popen.pid) for d in daemons]
    w0 = _last_fleet(host)
    m0, t0, tok0, fin0 = machine_busy_s(), time.monotonic(), fe.tokens, fe.finished
    await asyncio.sleep(seconds)
    c1 = [cpu_s(d.popen.pid) for d in daemons]
    w1 = _last_fleet(host)
    m1, t1, tok1, fin1 = machine_busy_s(), time.monotonic(), fe.tokens, fe.finished
    statuses = [await _status(a) for a in addrs]
    fe.stop = True
    front.cancel()
    await asyncio.gather(front, return_exceptions=True)
    assert w0 is not None and w1 is not None
    window = t1 - t0
    steps = w1["steps"] - w0["steps"]
    busy = [b1 - b0 for b0, b1 in zip(w0["busy"], w1["busy"], strict=True)]
    wait = [x1 - x0 for x0, x1 in zip(w0["wait"], w1["wait"], strict=True)]
    idle = [w / (b + w) if b + w > 0 else 0.0 for b, w in zip(busy, wait, strict=True)]
    cpu = [b - a for a, b in zip(c0, c1, strict=True)]
    tokens = tok1 - tok0
    out: dict[str, Any] = {
        "instances": len(busy),
        "daemons": len(daemons),
        "window_s": round(window, 2),
        "instance_steps_per_s": round(steps / window, 1),
        "mean_step_ms": round(1000 * sum(busy) / steps, 2) if steps else 0.0,
        # Of the window, the fraction the sim GPUs computed (mean over instances): below 1
        # with no control-plane idle means the worker host itself ran short of CPU.
        "gpu_busy_frac": round(sum(busy) / (len(busy) * window), 3),
        "daemon_cpu_us_per_step": round(1e6 * sum(cpu) / steps, 1) if steps else 0.0,
        "daemon_cpu_cores": [round(c / window, 3) for c in cpu],
        "idle_frac_control_plane_max": round(max(idle), 4),
        "idle_frac_control_plane_mean": round(sum(idle) / len(idle), 4),
        "tokens_per_s": round(tokens / window, 1),
        "requests_per_s": round((fin1 - fin0) / window, 1),
        "cpu_us_per_token": round(1e6 * sum(cpu) / tokens, 2) if tokens else 0.0,
        "machine_busy_cores": round((m1 - m0) / window, 2),
    }
    clusters = [s.cluster for s in statuses if s.HasField("cluster")]
    if clusters:
        fwd = sum(c.num_forwarded for c in clusters)
        routed = fwd + sum(c.num_routed_local for c in clusters)
        out["forwarded_share"] = round(fwd / routed, 3) if routed else 0.0
        out["route_us_p50"] = round(max(c.route_us_p50 for c in clusters), 1)
        out["route_us_p99"] = round(max(c.route_us_p99 for c in clusters), 1)
        out["prefix_routed_share"] = (
            round(sum(c.num_prefix_routed for c in clusters) / routed, 3) if routed else 0.0
        )
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("daemons", "daemons"),
        ("instances", "inst"),
        ("instance_steps_per_s", "steps/s"),
        ("mean_step_ms", "step ms"),
        ("gpu_busy_frac", "gpu busy"),
        ("daemon_cpu_us_per_step", "cpu us/step"),
        ("daemon_cpu_cores", "daemon cores"),
        ("idle_frac_control_plane_max", "cp idle max"),
        ("tokens_per_s", "tokens/s"),
        ("cpu_us_per_token", "cpu us/tok"),
        ("route_us_p50", "route p50 us"),
        ("route_us_p99", "route p99 us"),
        ("forwarded_share", "fwd share"),
    ]
    lines = [" | ".join(h for _, h in cols)]
    for r in rows:
        lines.append(" | ".join(str(r.get(k, "-")) for k, _ in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--instances", default="8,16,32")
    p.add_argument("--two-daemons", default="32", help="instance counts run under 2 daemons")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--per-instance", type=int, default=8, help="requests kept running each")
    p.add_argument(
        "--speed",
        type=float,
        default=0.5,
        help="sim speed (0.5: the H100 fit's steps take twice as long, ~10-15 ms here)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--worker-host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--servers", default="", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, default=16, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_host:
        asyncio.run(_worker_host(args.servers.split(","), args.count, "f", args.slots, args.speed))
        return 0
    rows = []
    cases = [(int(n), 1) for n in args.instances.split(",") if n]
    cases += [(int(n), 2) for n in args.two_daemons.split(",") if n]
    for num, daemons in cases:
        row = run_case(num, daemons, args.seconds, args.per_instance, args.speed)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    one = {r["instances"]: r for r in rows if r["daemons"] == 1}
    for r in rows:
        base = one.get(r["instances"])
        if r["daemons"] == 2 and base is not None:
            r["forwarding_overhead_us_per_token"] = round(
                r["cpu_us_per_token"] - base["cpu_us_per_token"], 2
            )
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "command": "python -m bench.fleet " + " ".join(argv or sys.argv[1:]),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, noisy, shared",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
