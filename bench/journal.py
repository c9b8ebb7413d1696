"""Journal cost: bench.transport with the daemon's journal off and on, in one run, and the
submit latency the journal adds.

    python -m bench.journal [--running 256] [--seconds 8] [--repeat 3] [--max-tokens 256]
                            [--submits 300] [--json bench/results/journal.json]

One nats-server with JetStream (kvsched.cluster.natsd) serves the whole run. For each R the
transport case (bench.transport: real daemon, one zero-cost sim worker with R slots, a Session
front end keeping R requests running) runs back to back without the journal (a standalone
daemon) and with it (`--cluster`, journal on, journal_flush_ms default); the verdict is the
median over the pairs of journal / no-journal steps/s (target >= 0.95). With `--max-tokens`
low, requests turn over during the window, so accepted and finished records are priced along
with the token deltas.

Submit latency: on the same kind of stack, `--submits` Generate calls one after another
(max_tokens 1), each timed from the call to its `queued` response; p50/p99 without and with the
journal (the accepted record is stored and acknowledged before `queued`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.transport_stack import machine, run_case, start_stack
from kvsched.client import AsyncClient
from kvsched.cluster.natsd import NatsServer

DEFAULT_JSON = Path(__file__).parent / "results" / "journal.json"
TARGET_RATIO = 0.95


def journal_env(nats: NatsServer, daemon_id: str) -> dict[str, str]:
    return {"KVSCHED_CLUSTER": nats.url, "KVSCHED_DAEMON_ID": daemon_id}


async def _submits(address: str, n: int) -> list[float]:
    out = []
    async with AsyncClient(address) as client:
        for i in range(n):
            t = time.perf_counter()
            stream = await client.generate([3 + i % 100, 4, 5, 6], max_tokens=1)
            out.append(time.perf_counter() - t)
            await stream.tokens()
    return out


def submit_latency(n: int, env: dict[str, str]) -> dict[str, float]:
    stack = start_stack(64, "none", env)
    try:
        asyncio.run(_submits(stack.address, min(n, 20)))  # warm-up
        lat = sorted(asyncio.run(_submits(stack.address, n)))
    finally:
        stack.stop()
    return {
        "p50_ms": round(1e3 * statistics.median(lat), 3),
        "p99_ms": round(1e3 * lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", default="256", help="running batch sizes, comma separated")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3, help="back-to-back off/on pairs per R")
    ap.add_argument("--max-tokens", type=int, default=256, help="per request (turnover)")
    ap.add_argument("--submits", type=int, default=300)
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    sizes = [int(x) for x in args.running.split(",") if x.strip()]
    print(f"kvsched journal cost: machine {machine()}; noisy, shared with other jobs")
    records: dict[str, Any] = {"cases": [], "submit_latency": {}}
    with NatsServer() as nats:
        for n in sizes:
            pairs = []
            for i in range(args.repeat):
                off = run_case(n, "none", args.seconds, args.warmup, 1, args.max_tokens)
                on = run_case(
                    n,
                    "none",
                    args.seconds,
                    args.warmup,
                    1,
                    args.max_tokens,
                    journal_env(nats, f"bench-{n}-{i}"),
                )
                ratio = on["steps_per_s"] / off["steps_per_s"] if off["steps_per_s"] else 0.0
                pairs.append(
                    {
                        "off_steps_per_s": off["steps_per_s"],
                        "on_steps_per_s": on["steps_per_s"],
                        "ratio": round(ratio, 3),
                        "off_daemon_us_per_step": off["daemon_cpu_us_per_step"],
                        "on_daemon_us_per_step": on["daemon_cpu_us_per_step"],
                        "on_finished_in_window": on["finished_in_window"],
                        "other_load_cores": max(off["other_load_cores"], on["other_load_cores"]),
                    }
                )
                print(
                    f"  running {n} pair {i + 1}: off {off['steps_per_s']:,.0f} / on "
                    f"{on['steps_per_s']:,.0f} steps/s = {ratio:.3f}; daemon us/step "
                    f"{off['daemon_cpu_us_per_step']:,.0f} -> {on['daemon_cpu_us_per_step']:,.0f}; "
                    f"{on['finished_in_window']} requests turned over",
                    flush=True,
                )
            med = statistics.median(p["ratio"] for p in pairs)
            records["cases"].append(
                {"running": n, "max_tokens": args.max_tokens, "pairs": pairs, "median_ratio": med}
            )
        off_lat = submit_latency(args.submits, {})
        on_lat = submit_latency(args.submits, journal_env(nats, "bench-submit"))
    records["submit_latency"] = {"off": off_lat, "on": on_lat}
    print()
    print(f"{'running':>7} {'median on/off steps/s':>22} {'target':>7}  result")
    for c in records["cases"]:
        ok = "PASS" if c["median_ratio"] >= TARGET_RATIO else "MISS"
        print(f"{c['running']:>7} {c['median_ratio']:>22.3f} {'>= 0.95':>7}  {ok}")
    print(
        f"submit -> queued: off p50 {off_lat['p50_ms']:.2f} ms p99 {off_lat['p99_ms']:.2f} ms; "
        f"on p50 {on_lat['p50_ms']:.2f} ms p99 {on_lat['p99_ms']:.2f} ms"
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
