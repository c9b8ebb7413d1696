"""Two tenants, one of which floods: the quiet tenant's latency with and without fair shares.

    python -m bench.tenants [--duration S] [--instances N] [--quiet-rate X] [--flood-rate Y]
                            [--configs a,b] [--json OUT]

The Mooncake conversation trace's first `--duration` seconds serve both tenants on N simulated
H100s (`bench.simulate`, the sizes of `bench.policies`): "quiet" replays the trace at
`--quiet-rate` times its rate (default 0.5: about 40 % of the fleet), "flood" replays it again
at `--flood-rate` (default 1.5: about 125 %), starting together, each with prompts of its own
(the flood's token ids shifted, so the two share no prefix). Together they ask ~165 % of what
the fleet serves while the flood lasts: a queue builds, and the question is whose requests
wait in it.

    fcfs          no fairness: one queue in arrival order (the flood's backlog is ahead of
                  every quiet request that arrives after it)
    vtc           the `slo` queue policy (kvsched's default): virtual token counters, equal
                  weights: each backlogged tenant gets half the served tokens
    vtc-quiet-x3  the same, the quiet tenant weighted 3:1

Prints one row per (config, tenant): completed, goodput (TTFT <= 5 s, TPOT <= 100 ms),
TTFT p50/p99, TPOT p99, and writes bench/results/tenants.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.policies import DEFAULT_TRACE, MAX_NUM_BATCHED_TOKENS, base_config, write_json
from bench.simulate import KvschedCluster, offered_work_s, simulate
from kvsched.core import EngineConfig
from kvsched.core.config import QueuePolicy
from kvsched.replay.summary import RequestRecord, summarize
from kvsched.traces import TraceRequest, load_trace

DEFAULT_JSON = Path(__file__).parent / "results" / "tenants.json"
FLOOD_TOKEN_SHIFT = 16_000  # the trace's ids are < 32,000: no shared prefix between tenants


def fcfs_config() -> EngineConfig:
    cfg = base_config()
    cfg.scheduler.policy = QueuePolicy.FCFS
    return cfg


def vtc_quiet_x3_config() -> EngineConfig:
    cfg = base_config()
    cfg.fairness.tenant_weights = {"quiet": 3.0, "flood": 1.0}
    return cfg


CONFIGS: dict[str, Callable[[], EngineConfig]] = {
    "fcfs": fcfs_config,
    "vtc": base_config,
    "vtc-quiet-x3": vtc_quiet_x3_config,
}


def two_tenants(
    trace: list[TraceRequest], quiet_rate: float, flood_rate: float
) -> tuple[list[TraceRequest], dict[str, str]]:
    """Both tenants' requests in arrival order, and each request's tenant by record id."""
    tagged: list[tuple[float, str, TraceRequest]] = []
    for tr in trace:
        tagged.append((tr.arrival_s / quiet_rate, "quiet", tr))
        flood = TraceRequest(
            tr.arrival_s / flood_rate,
            [(t + FLOOD_TOKEN_SHIFT) % 32_000 for t in tr.prompt_token_ids],
            tr.max_tokens,
        )
        tagged.append((flood.arrival_s, "flood", flood))
    tagged.sort(key=lambda x: x[0])
    requests, tenant_of = [], {}
    for i, (arrival, tenant, tr) in enumerate(tagged):
        requests.append(dataclasses.replace(tr, arrival_s=arrival))
        tenant_of[f"r{i}"] = tenant  # simulate() names records r0, r1, ... in this order
    return requests, tenant_of


def run(
    requests: list[TraceRequest], tenant_of: dict[str, str], name: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    config = CONFIGS[name]()
    factory = KvschedCluster.factory(
        config,
        num_instances=args.instances,
        name=name,
        tenant_of=lambda rec: tenant_of[rec.req_id],
    )
    result = simulate(requests, factory)
    rows = []
    for tenant in ("quiet", "flood"):
        recs: list[RequestRecord] = [r for r in result.records if tenant_of[r.req_id] == tenant]
        out = summarize(
            recs,
            num_gpu_blocks=result.num_gpu_blocks,
            block_size=result.block_size,
            preemptions=result.num_preemptions,
        )
        out.update(config=name, tenant=tenant, sim_wall_s=result.wall_s)
        rows.append(out)
    return rows


def _f(x: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
    return "-" if x is None else format(scale * x, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':14} {'tenant':7} {'done':>6} {'goodput':>8} {'TTFT p50':>9} {'p99':>7} "
        f"{'TPOT p99':>9} {'tok/s':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['config']:14} {r['tenant']:7} {r['completed']:>6} "
            f"{100 * r['goodput_frac']:>7.0f}% {_f(r['ttft_s']['p50']):>9} "
            f"{_f(r['ttft_s']['p99']):>7} {_f(r['tpot_s']['p99'], 1e3, '.0f'):>7}ms "
            f"{r['output_tokens_per_s']:>6.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--duration", type=float, default=300.0, help="trace seconds per tenant")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--quiet-rate", type=float, default=0.5)
    ap.add_argument("--flood-rate", type=float, default=1.5)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    t0 = time.perf_counter()
    trace = load_trace(args.trace, duration_s=args.duration)
    requests, tenant_of = two_tenants(trace, args.quiet_rate, args.flood_rate)
    span = args.duration / args.flood_rate
    work = offered_work_s(trace, "h100", MAX_NUM_BATCHED_TOKENS)
    quiet_util = work / (args.duration / args.quiet_rate * args.instances)
    flood_util = work / (span * args.instances)
    print(
        f"trace {args.trace.name}: first {args.duration:g} s ({len(trace)} requests) per tenant "
        f"on {args.instances} x H100; quiet x{args.quiet_rate:g} (est. {100 * quiet_util:.0f} %"
        f" of the fleet), flood x{args.flood_rate:g} (est. {100 * flood_util:.0f} % for "
        f"{span:.0f} s)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for name in names:
        out = run(requests, tenant_of, name, args)
        rows += out
        print(f"  {name}: {out[0]['sim_wall_s']:.1f} s", flush=True)
    print()
    print(table(rows))
    print("(goodput: share of the tenant's requests with TTFT <= 5 s and TPOT <= 100 ms)")
    meta = {
        "trace": str(args.trace),
        "duration_s": args.duration,
        "instances": args.instances,
        "quiet_rate": args.quiet_rate,
        "flood_rate": args.flood_rate,
        "est_utilisation": {"quiet": quiet_util, "flood": flood_util},
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
        "wall_s": time.perf_counter() - t0,
    }
    write_json(args.json, {**meta, "results": rows})


if __name__ == "__main__":
    main()
