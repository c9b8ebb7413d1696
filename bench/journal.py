"""Journal cost: bench.transport with the daemon's journal off and on, in one run, and the
submit latency the journal adds.

    python -m bench.journal [--running 256] [--seconds 8] [--repeat 3] [--max-tokens 256]
                            [--submits 300] [--old-src DIR] [--json bench/results/journal.json]

One nats-server with JetStream (kvsched.cluster.natsd) serves the whole run. For each R the
transport case (bench.transport: real daemon, one zero-cost sim worker with R slots, a Session
front end keeping R requests running) runs back to back in each mode, a round per repeat (the
order rotated each round):

    off       a standalone daemon (no NATS)
    cluster   `--cluster` with the journal off (KVSCHED_JOURNAL=false): membership, leases,
              the KV event stream, cluster routing; what the journal is added to
    on        `--cluster`, journal on (journal_flush_ms default)
    old       the same as `on`, the daemon run from `--old-src` (another checkout, e.g. main's
              tree from `git archive main`), for a side-by-side before/after

The journal's own cost is on vs cluster; on vs off adds the cluster's. Per case: daemon CPU per
step (tokens / R), per scheduled step, and per finished request (the daemon's whole CPU over
the requests that turned over in the window; the difference of two modes is what one request
costs more). With `--max-tokens` low, requests turn over during the window, so accepted and
finished records are priced along with the token deltas. A case that cannot start (the ramp
bounded at --ramp-s on a busy machine) is recorded as failed, with why, and the run goes on.

Submit latency: on the same kind of stack, `--submits` Generate calls one after another
(max_tokens 1), each timed from the call to its `queued` response; p50/p99 per mode (with the
journal the accepted record is stored and acknowledged before `queued`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import transport_stack as ts
from bench.transport_stack import machine, start_stack
from kvsched.client import AsyncClient, KvschedClientError
from kvsched.cluster.natsd import NatsServer

DEFAULT_JSON = Path(__file__).parent / "results" / "journal.json"
TARGET_CPU_RISE = 0.20  # journal on vs cluster: daemon CPU per step at most +20 %
TARGET_SUBMIT_P99_MS = 5.0


def journal_env(nats: NatsServer, daemon_id: str, journal: bool = True) -> dict[str, str]:
    env = {"KVSCHED_CLUSTER": nats.url, "KVSCHED_DAEMON_ID": daemon_id}
    if not journal:
        env["KVSCHED_JOURNAL"] = "false"
    return env


def mode_setup(
    mode: str, nats: NatsServer, daemon_id: str, old_src: str | None
) -> tuple[dict[str, str], str | None]:
    """(daemon env, daemon source dir) of a mode."""
    if mode == "off":
        return {}, None
    if mode == "cluster":
        return journal_env(nats, daemon_id, journal=False), None
    return journal_env(nats, daemon_id), (old_src if mode == "old" else None)


async def _submits(address: str, n: int) -> list[float]:
    out = []
    async with AsyncClient(address) as client:
        for i in range(n):
            t = time.perf_counter()
            stream = await client.generate([3 + i % 100, 4, 5, 6], max_tokens=1)
            out.append(time.perf_counter() - t)
            await stream.tokens()
    return out


def submit_latency(n: int, env: dict[str, str], cwd: str | None = None) -> dict[str, float]:
    stack = start_stack(64, "none", env, cwd)
    try:
        asyncio.run(_submits(stack.address, min(n, 20)))  # warm-up
        lat = sorted(asyncio.run(_submits(stack.address, n)))
    finally:
        stack.stop()
    return {
        "p50_ms": round(1e3 * statistics.median(lat), 3),
        "p99_ms": round(1e3 * lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def one_case(
    n: int, args: argparse.Namespace, env: dict[str, str], cwd: str | None
) -> dict[str, Any]:
    """One measured case, or {"failed": why} when it could not run (the ramp's time bound, a
    daemon that did not start)."""
    try:
        return ts.run_case(
            n, "none", args.seconds, args.warmup, 1, args.max_tokens, env, cwd, args.ramp_s
        )
    except (RuntimeError, TimeoutError, OSError, KvschedClientError) as exc:  # NotRunning too
        return {"failed": f"{type(exc).__name__}: {exc}"}


def summarize(cases: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: medians of the figures over its successful runs."""
    out: dict[str, Any] = {}
    for mode, runs in cases.items():
        ok = [r for r in runs if "failed" not in r]
        if not ok:
            out[mode] = {"runs": 0, "failed": len(runs)}
            continue
        out[mode] = {
            "runs": len(ok),
            "failed": len(runs) - len(ok),
            **{
                k: round(statistics.median(r[k] for r in ok), 1)
                for k in (
                    "steps_per_s",
                    "daemon_cpu_us_per_step",
                    "daemon_cpu_us_per_schedule",
                    "daemon_cpu_us_per_finished",
                    "daemon_cpu_frac",
                    "finished_in_window",
                    "other_load_cores",
                )
            },
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", default="256", help="running batch sizes, comma separated")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3, help="rounds (one run of each mode) per R")
    ap.add_argument("--max-tokens", type=int, default=256, help="per request (turnover)")
    ap.add_argument("--submits", type=int, default=300)
    ap.add_argument("--ramp-s", type=float, default=60.0, help="bound on each case's ramp")
    ap.add_argument(
        "--modes", default="off,cluster,on", help="of off,cluster,on,old (old needs --old-src)"
    )
    ap.add_argument("--old-src", default=None, help="another checkout's root: mode `old`")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    sizes = [int(x) for x in args.running.split(",") if x.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "old" in modes and not args.old_src:
        ap.error("mode `old` needs --old-src")
    print(f"kvsched journal cost: machine {machine()}; noisy, shared with other jobs")
    print(f"load average at start {load_average()}")
    records: dict[str, Any] = {
        "machine": machine(),
        "command": "python -m bench.journal " + " ".join(sys.argv[1:]),
        "load_average_start": load_average(),
        "cases": [],
        "submit_latency": {},
    }
    with NatsServer() as nats:
        for n in sizes:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for i in range(args.repeat):
                # Rotated each round: no mode always runs first (the machine's load drifts).
                for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                    env, cwd = mode_setup(mode, nats, f"bench-{mode}-{n}-{i}", args.old_src)
                    rec = one_case(n, args, env, cwd)
                    rec["load_average"] = load_average()
                    runs[mode].append(rec)
                    if "failed" in rec:
                        print(f"  running {n} round {i + 1} {mode:>7}: FAILED {rec['failed']}")
                        continue
                    print(
                        f"  running {n} round {i + 1} {mode:>7}: {rec['steps_per_s']:,.0f} "
                        f"steps/s; daemon CPU {rec['daemon_cpu_us_per_step']:,.0f} us/step, "
                        f"{rec['daemon_cpu_us_per_finished']:,.0f} us/finished request; "
                        f"{rec['finished_in_window']} turned over; load {rec['load_average'][0]}",
                        flush=True,
                    )
            records["cases"].append(
                {
                    "running": n,
                    "max_tokens": args.max_tokens,
                    "seconds": args.seconds,
                    "runs": runs,
                    "median": summarize(runs),
                }
            )
        lat: dict[str, Any] = {}
        for mode in modes:
            env, cwd = mode_setup(mode, nats, f"bench-submit-{mode}", args.old_src)
            try:
                lat[mode] = submit_latency(args.submits, env, cwd)
            except (RuntimeError, TimeoutError, OSError, KvschedClientError) as exc:
                lat[mode] = {"failed": f"{type(exc).__name__}: {exc}"}
    records["submit_latency"] = lat
    records["load_average_end"] = load_average()
    print()
    report(records)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


def report(records: dict[str, Any]) -> None:
    print(
        f"{'running':>7} {'mode':>7} {'runs':>4} {'steps/s':>8} {'us/step':>8} "
        f"{'us/sched':>8} {'us/req':>8} {'req/s':>6}"
    )
    for c in records["cases"]:
        med = c["median"]
        for mode, m in med.items():
            if not m["runs"]:
                print(f"{c['running']:>7} {mode:>7} {0:>4}  (all {m['failed']} failed)")
                continue
            print(
                f"{c['running']:>7} {mode:>7} {m['runs']:>4} {m['steps_per_s']:>8,.0f} "
                f"{m['daemon_cpu_us_per_step']:>8,.0f} {m['daemon_cpu_us_per_schedule']:>8,.0f} "
                f"{m['daemon_cpu_us_per_finished']:>8,.0f} "
                f"{m['finished_in_window'] / c['seconds']:>6,.0f}"
            )
        for base in ("cluster", "off"):
            for mode in ("on", "old"):
                if med.get(base, {}).get("runs") and med.get(mode, {}).get("runs"):
                    rise = (
                        med[mode]["daemon_cpu_us_per_step"] / med[base]["daemon_cpu_us_per_step"]
                        - 1.0
                    )
                    ok = "met" if rise <= TARGET_CPU_RISE else "not met"
                    print(
                        f"  daemon CPU/step {mode} vs {base}: {100 * rise:+.0f} % "
                        f"(target <= +{100 * TARGET_CPU_RISE:.0f} %: {ok})"
                    )
    for mode, lat in records["submit_latency"].items():
        if "failed" in lat:
            print(f"submit -> queued {mode}: FAILED {lat['failed']}")
        else:
            print(
                f"submit -> queued {mode:>7}: p50 {lat['p50_ms']:.2f} ms p99 {lat['p99_ms']:.2f} "
                f"ms (target p99 < {TARGET_SUBMIT_P99_MS:g} ms with the journal)"
            )
    print(f"load average at end {records['load_average_end']}")


if __name__ == "__main__":
    main()
