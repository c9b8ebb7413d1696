"""Placement at overload: kvsched's router against count-based placement, per trace window and
load, with kvsched's own scheduler on both sides (no vLLM needed).

    .venv/bin/python -m bench.placement [--windows 0,900,1800,2700] [--duration 300]
        [--loads 0.8,1.1,1.2,1.3] [--instances 4] [--placements kvsched,count] [--json OUT]

Each window is `--duration` seconds of the whole Mooncake conversation trace
(tests/data/mooncake_conversation.jsonl.xz, 12,031 requests over ~59 minutes) starting at the
given second; its arrivals are scaled so that its estimated utilisation (`offered_work_s`: the
cost model's GPU-seconds with no prefix hits, over instances x span) is each `--loads` value.
Placements: `kvsched` is `kvsched.core.Router` as the daemon runs it; `count` is the rule
`bench.peers` used for vLLM's instances (the same score, load = requests per slot + KV usage);
`seconds` is the router before issue 25 (load = predicted queued prefill seconds + KV usage,
no deadline check); `refuse`: kvsched's router refusing (with a retry hint) what it would
demote; `uncalibrated`: kvsched's router with its predicted waits taken as they are. Same scheduler config (`seed-x2`), simulator, H100 cost model and sampled
tokens for all. Goodput: finished with TTFT <= 5 s and TPOT <= 100 ms, counted in requests
(refused ones count as not good). Latencies are virtual time: the load of the machine running
this does not change them. Writes bench/results/placement.json.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench.peer_modes import kvsched_factory  # noqa: E402
from bench.policies import CONFIGS, write_json  # noqa: E402
from bench.simulate import offered_work_s, simulate  # noqa: E402
from kvsched.core import Request, Scheduler  # noqa: E402
from kvsched.core.router import Router, backlog_load, best_by_score  # noqa: E402
from kvsched.replay.summary import DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S  # noqa: E402
from kvsched.traces import TraceRequest, load_trace  # noqa: E402

FULL_TRACE = _REPO / "tests" / "data" / "mooncake_conversation.jsonl.xz"
DEFAULT_JSON = _REPO / "bench" / "results" / "placement.json"
PLACEMENTS = ("kvsched", "count", "seconds", "refuse", "uncalibrated")


class ScoreRouter(Router):
    """The score rule alone (prefix fraction minus load_weight x load above the least loaded),
    over a load function: the placements kvsched is compared with."""

    def __init__(self, count: bool) -> None:
        super().__init__()
        self.count = count

    def pick(self, schedulers: Sequence[Scheduler], req: Request) -> int:
        n = max(1, len(req.prompt_token_ids))
        hits = [s.prefix_hit_tokens(req) / n for s in schedulers]
        if self.count:
            loads = [self.count_load(s) for s in schedulers]
        else:
            loads = [
                backlog_load(s.predicted_backlog_ms(), s.kv.usage, self.load_seconds)
                for s in schedulers
            ]
        return best_by_score(hits, loads, self.load_weight)


def window(path: Path, start_s: float, duration_s: float) -> list[TraceRequest]:
    """The requests arriving in [start_s, start_s + duration_s), times from the window's start
    (token ids depend on the hash ids only, so a window's prompts are the full trace's)."""
    lines = []
    with lzma.open(path, "rt") if path.suffix == ".xz" else open(path) as f:
        for line in f:
            row = json.loads(line)
            t = row["timestamp"] / 1e3
            if t >= start_s + duration_s:
                break
            if t >= start_s:
                row["timestamp"] = round((t - start_s) * 1e3)
                lines.append(json.dumps(row))
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "window.jsonl"
        p.write_text("\n".join(lines) + "\n")
        return load_trace(p)


def run(
    requests: list[TraceRequest], placement: str, rate_scale: float, args: argparse.Namespace
) -> dict[str, Any]:
    make = kvsched_factory(CONFIGS[args.config](), args.instances, "h100", 0.0, placement)

    def factory(loop: Any) -> Any:
        cluster = make(loop)
        if placement in ("count", "seconds"):
            cluster.router = ScoreRouter(count=placement == "count")
        elif placement == "refuse":
            cluster.router = Router(overload="refuse")
        elif placement == "uncalibrated":
            cluster.router = Router()
            cluster.router.calibration.alpha = 0.0  # predictions taken as they are
        return cluster

    t0 = time.perf_counter()
    res = simulate(requests, factory, rate_scale=rate_scale)
    s = res.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    good = round(s["goodput_frac"] * s["requests"])
    refused = sum(1 for r in res.records if r.finish_reason == "rejected")
    return {
        "placement": placement,
        "good": good,
        "goodput_frac": s["goodput_frac"],
        "goodput_rps": s["goodput_rps"],
        "refused": refused,
        "completed": s["completed"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p99_s": s["tpot_s"]["p99"],
        "prefix_hit_rate": s["prefix_hit_rate"],
        "preemptions": s["preemptions"],
        "wall_s": time.perf_counter() - t0,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'window s':>9} {'load':>5} {'reqs':>5} {'placement':9} {'good':>5} {'good %':>6} "
        f"{'vs count':>8} {'refused':>7} {'TTFT p50':>8} {'p99':>6} {'hit %':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['window_s']:>9} {r['load']:>5.2f} {r['requests']:>5} {r['placement']:9} "
            f"{r['good']:>5} {100 * r['goodput_frac']:>6.1f} {r['vs_count']:>8.2f} "
            f"{r['refused']:>7} {r['ttft_p50_s']:>8.2f} {r['ttft_p99_s']:>6.2f} "
            f"{100 * r['prefix_hit_rate']:>5.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=FULL_TRACE)
    ap.add_argument("--windows", default="0,900,1800,2700", help="window starts, trace seconds")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--loads", default="0.8,1.1,1.2,1.3", help="estimated utilisations")
    ap.add_argument("--placements", default="kvsched,count")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--config", default="seed-x2", choices=list(CONFIGS))
    ap.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO_TTFT_S)
    ap.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO_TPOT_S)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    placements = args.placements.split(",")
    if "count" not in placements or any(p not in PLACEMENTS for p in placements):
        ap.error(f"--placements: from {PLACEMENTS}; count included (the baseline)")
    rows: list[dict[str, Any]] = []
    for start in [float(w) for w in args.windows.split(",")]:
        requests = window(args.trace, start, args.duration)
        util = offered_work_s(requests) / (args.duration * args.instances)
        for load in [float(x) for x in args.loads.split(",")]:
            cell = []
            for p in placements:
                out = run(requests, p, load / util, args)
                out.update(window_s=int(start), load=load, requests=len(requests))
                print(
                    f"window {start:.0f} s load {load:.2f}: {p} {out['good']} good "
                    f"({out['wall_s']:.0f} s)",
                    flush=True,
                )
                cell.append(out)
            base = next(r["good"] for r in cell if r["placement"] == "count")
            for r in cell:
                r["vs_count"] = r["good"] / max(1, base)
            rows.extend(cell)
            write_json(
                args.json,
                {
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "rows": rows,
                },
            )
    print()
    print(table(rows))
    print(
        f"(good: finished with TTFT <= {args.slo_ttft:g} s and TPOT <= "
        f"{1e3 * args.slo_tpot:g} ms, of all requests; vs count: good / count placement's good)"
    )


if __name__ == "__main__":
    main()
