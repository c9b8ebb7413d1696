"""`bench.peers --windows ... --loads ...`: kvsched's placement against count-based placement,
with each scheduler (kvsched's and vLLM's) held fixed, per trace window and load (issue 25).

    /tmp/vllmvenv/bin/python -m bench.peers --windows 0,900,1800,2700 --loads 0.8,1.1,1.2,1.3 \
        [--no-vllm] [--json bench/results/peers_grid.json]

Each window is `--duration` seconds of the whole Mooncake conversation trace starting at the
given second (`bench.placement.window`); its arrivals are scaled so that its estimated
utilisation (`offered_work_s` over instances x span) is each load. Per cell, four runs on the
same requests, simulator, H100 cost model and sampled tokens:

- kvsched / kvsched: kvsched's scheduler behind kvsched's Router as the daemon runs it (deadline
  check, calibrated waits, `routing_overload = demote`);
- kvsched / count: kvsched's scheduler behind the count-based placement (the same score, load =
  requests per slot + KV usage: `bench.placement.ScoreRouter(count=True)`);
- vLLM / count: vLLM's scheduler behind the same count-based rule over vLLM's state (bench.peers'
  `routed` row for vLLM);
- vLLM / kvsched: vLLM's scheduler serving the placement kvsched's router made in the first run,
  request by request (bench.peers' `pinned` row).

Goodput counts requests finished with TTFT <= 5 s and TPOT <= 100 ms over all requests. The JSON
is rewritten after every cell, so a long run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.peer_modes import kvsched_factory, recorded_placement, vllm_factory
from bench.placement import FULL_TRACE, ScoreRouter, window
from bench.policies import CONFIGS, DEFAULT_TRACE, write_json
from bench.simulate import offered_work_s, simulate
from kvsched.traces import TraceRequest

# (scheduler, placement) of the four runs of a cell, in the order they run
RUNS = (("kvsched", "kvsched"), ("kvsched", "count"), ("vllm", "count"), ("vllm", "kvsched"))


def _summary(res: Any, args: argparse.Namespace, sched: str, place: str, t0: float) -> dict:
    s = res.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    return {
        "scheduler": sched,
        "placement": place,
        "good": round(s["goodput_frac"] * s["requests"]),
        "goodput_frac": s["goodput_frac"],
        "goodput_rps": s["goodput_rps"],
        "completed": s["completed"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p99_s": s["tpot_s"]["p99"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "preemptions": s["preemptions"],
        "wall_s": time.perf_counter() - t0,
    }


def cell(
    requests: list[TraceRequest], rate: float, args: argparse.Namespace, builder: Any
) -> list[dict[str, Any]]:
    """The four runs of one (window, load) cell (two without vLLM)."""
    config = CONFIGS[args.configs.split(",")[0]]()
    n, gpu, lat = args.instances, args.gpu, args.control_latency
    rows: list[dict[str, Any]] = []
    placement: list[int] = []
    for sched, place in RUNS:
        if sched == "vllm" and builder is None:
            continue
        t0 = time.perf_counter()
        name = f"{sched} / {place}"
        if sched == "kvsched":
            make = kvsched_factory(config, n, gpu, lat, name)
            count = place == "count"

            def factory(loop: Any, make: Any = make, count: bool = count) -> Any:
                cluster = make(loop)
                if count:
                    cluster.router = ScoreRouter(count=True)
                return cluster

            res = simulate(requests, factory, rate_scale=rate)
            if place == "kvsched":
                placement = recorded_placement(res)
        else:
            pin = placement if place == "kvsched" else None
            res = simulate(requests, vllm_factory(builder, n, gpu, name, pin), rate_scale=rate)
        rows.append(_summary(res, args, sched, place, t0))
        print(f"    {name}: {rows[-1]['good']} good ({rows[-1]['wall_s']:.0f} s)", flush=True)
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """kvsched's placement over count-based, per scheduler; kvsched's whole over vLLM/count."""
    good = {(r["scheduler"], r["placement"]): r["good"] for r in rows}
    out: dict[str, float] = {}
    for sched in ("kvsched", "vllm"):
        if (sched, "count") in good and (sched, "kvsched") in good:
            out[f"{sched}_placement_vs_count"] = good[sched, "kvsched"] / max(
                1, good[sched, "count"]
            )
    if ("vllm", "count") in good:
        out["kvsched_vs_vllm_count"] = good["kvsched", "kvsched"] / max(1, good["vllm", "count"])
    return out


def grid(args: argparse.Namespace, builder: Any, meta: dict[str, Any]) -> list[dict[str, Any]]:
    trace = FULL_TRACE if args.trace == DEFAULT_TRACE else args.trace  # the whole trace
    cells: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for start in [float(w) for w in args.windows.split(",")]:
        requests = window(trace, start, args.duration)
        util = offered_work_s(requests) / (args.duration * args.instances)
        for load in [float(x) for x in args.loads.split(",")]:
            print(f"window {start:.0f} s, load {load:.2f} ({len(requests)} requests)", flush=True)
            rows = cell(requests, load / util, args, builder)
            cells.append(
                {
                    "window_s": int(start),
                    "load": load,
                    "requests": len(requests),
                    "rows": rows,
                    **ratios(rows),
                }
            )
            write_json(
                args.json,
                {
                    **meta,
                    "trace": str(trace),
                    "windows": args.windows,
                    "loads": args.loads,
                    "wall_s": time.perf_counter() - t_start,
                    "cells": cells,
                },
            )
    print()
    print(table(cells))
    return cells


def table(cells: list[dict[str, Any]]) -> str:
    head = (
        f"{'window s':>9} {'load':>5} {'reqs':>5} {'kv/kv':>6} {'kv/cnt':>6} {'vl/cnt':>6} "
        f"{'vl/kv':>6} {'kv plc/cnt':>10} {'vl plc/cnt':>10} {'kv vs vl/cnt':>12}"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        good = {(r["scheduler"], r["placement"]): str(r["good"]) for r in c["rows"]}
        g = [good.get(k, "-") for k in RUNS]
        f = [
            f"{c[k]:.2f}" if k in c else "-"
            for k in (
                "kvsched_placement_vs_count",
                "vllm_placement_vs_count",
                "kvsched_vs_vllm_count",
            )
        ]
        lines.append(
            f"{c['window_s']:>9} {c['load']:>5.2f} {c['requests']:>5} {g[0]:>6} {g[1]:>6} {g[2]:>6} "
            f"{g[3]:>6} {f[0]:>10} {f[1]:>10} {f[2]:>12}"
        )
    lines.append(
        "(good requests: scheduler / placement; plc/cnt: kvsched's placement over count-based "
        "with that scheduler held fixed)"
    )
    return "\n".join(lines)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--windows", default=None, help="window starts (trace s): the grid mode")
    ap.add_argument("--loads", default="0.8,1.1,1.2,1.3", help="estimated utilisations (grid)")


def default_json(path: Path, default: Path) -> Path:
    return path if path != default else default.with_name("peers_grid.json")
