"""The shared storage KV tier (issue 25) on windows of the Mooncake conversation trace.

    python -m bench.storage [--trace PATH] [--windows 0-300,900-1200,...] [--configs a,b]
                            [--instances N] [--json OUT]

Each window's requests (arrivals shifted to start at 0) are served by each configuration in
`bench.simulate` (virtual time, the asynchronous worker protocol, the H100 cost model) on N
instances behind kvsched's Router, as `bench.policies` does:

    gpu-only            kvsched's defaults, no host tier, no storage tier
    host-4x             a host tier of 4x the GPU blocks per instance (write_back), no storage
    storage             host-4x + the shared storage tier, write_back from host (a block is
                        written when the host tier would evict it)
    storage-wt          host-4x + the shared storage tier, write_through (a block is written
                        as soon as it reaches an instance's host tier)
    storage-wt-400g     storage-wt with a 400 Gb/s NIC per GPU (50 GB/s, as a DGX H100 has)
    ideal               storage-wt whose transfers cost nothing (a bound, not a machine: the
                        TTFT any storage tier could give on this window, at these hit rates)

The storage tier is one StorageIndex for all instances (one daemon); the sim workers hold no
KV and simulate the store (every task succeeds, the store never evicts): each write or fetch is
priced by a block's bytes (8 MiB per 64-token Llama-3-8B block) over the sim's storage
bandwidth (12.5 GB/s, one 100 Gb/s NIC): fetches on the step's critical path, writes beside it.

Per window it prints the hit rate against an unbounded cache's over the same requests
(`kvsched.traces.ideal_lru_hit_rate(..., None, ...)`), TTFT p50 and goodput against gpu-only,
and writes bench/results/storage.json. Windows past the shipped slice's 300 s need the full
trace (KVSCHED_TRACE_DIR, as bench.policies).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.policies import (
    BLOCK_SIZE,
    DEFAULT_TRACE,
    HOST_FACTOR,
    NUM_GPU_BLOCKS,
    base_config,
    host_config,
    write_json,
)
from bench.simulate import KvschedCluster, offered_work_s, simulate
from kvsched.core import EngineConfig
from kvsched.core.config import WritePolicy
from kvsched.replay.summary import DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S
from kvsched.traces import TraceRequest, ideal_lru_hit_rate, ideal_lru_hits, load_trace

DEFAULT_JSON = Path(__file__).parent / "results" / "storage.json"
DEFAULT_WINDOWS = "0-300,900-1200,1800-2100,2700-3000"
# A 64-token block is 8 MiB: ~0.67 ms at 12.5 GB/s (the sim's storage bandwidth; the model
# learns the real figure from the steps that fetch).
FETCH_BLOCK_MS = 0.67


def storage_config(policy: str = "write_back", gbps: float = 12.5) -> EngineConfig:
    cfg = host_config("write_back")
    cfg.cache.storage_write_policy = WritePolicy(policy)
    cfg.step_cost.per_fetched_block_ms = FETCH_BLOCK_MS * 12.5 / gbps
    return cfg


# A 400 Gb/s NIC per GPU (DGX H100): 50 GB/s, ~0.17 ms per 8 MiB block, as fast as PCIe.
FAST_GBPS = 50.0
# The bound: a storage tier whose writes and fetches take no time (8 ns per 8 MiB block).
FREE_GBPS = 1e6

# name -> (config, with a storage tier, the sim's storage bandwidth in GB/s: None = its default)
CONFIGS: dict[str, tuple[Callable[[], EngineConfig], bool, float | None]] = {
    "gpu-only": (base_config, False, None),
    "host-4x": (lambda: host_config("write_back"), False, None),
    "storage": (storage_config, True, None),
    "storage-wt": (lambda: storage_config("write_through"), True, None),
    "storage-wt-400g": (lambda: storage_config("write_through", FAST_GBPS), True, FAST_GBPS),
    "ideal": (lambda: storage_config("write_through", FREE_GBPS), True, FREE_GBPS),
}


def window(requests: list[TraceRequest], start: float, end: float) -> list[TraceRequest]:
    """The requests arriving in [start, end), arrivals shifted to start at 0."""
    return [
        dataclasses.replace(r, arrival_s=r.arrival_s - start)
        for r in requests
        if start <= r.arrival_s < end
    ]


def parse_windows(text: str) -> list[tuple[float, float]]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        start, end = float(a), float(b)
        if not 0 <= start < end:
            raise ValueError(f"window {part!r}: need 0 <= start < end")
        out.append((start, end))
    return out


def cacheable_shares(requests: list[TraceRequest], block_size: int) -> list[float]:
    """Per request, the share of its prompt an unbounded prefix cache holds when it arrives
    (`ideal_lru_hits`): what any KV tier could save it."""
    return [hit / n if n else 0.0 for hit, n in ideal_lru_hits(requests, None, block_size)]


def run_window(
    requests: list[TraceRequest], names: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    unbounded = ideal_lru_hit_rate(requests, None, BLOCK_SIZE)
    gpu_host = ideal_lru_hit_rate(
        requests, (1 + HOST_FACTOR) * NUM_GPU_BLOCKS * args.instances, BLOCK_SIZE
    )
    span = max((r.arrival_s for r in requests), default=0.0)
    work = offered_work_s(requests, "h100", 8192)
    shares = sorted(cacheable_shares(requests, BLOCK_SIZE))
    rows = []
    for name in names:
        make, storage, gbps = CONFIGS[name]
        factory = KvschedCluster.factory(
            make(), num_instances=args.instances, name=name, storage=storage, storage_gbps=gbps
        )
        t0 = time.perf_counter()
        res = simulate(requests, factory)
        row = res.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
        row["hit_of_unbounded"] = row["prefix_hit_rate"] / unbounded if unbounded else None
        rows.append(row)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return {
        "num_requests": len(requests),
        "est_utilisation": work / (max(span, 1.0) * args.instances),
        "ideal_unbounded": unbounded,
        "ideal_gpu_host": gpu_host,
        "cacheable_share": {
            q: shares[min(len(shares) - 1, int(f * len(shares)))] if shares else 0.0
            for q, f in (("p25", 0.25), ("p50", 0.5), ("p75", 0.75))
        },
        "results": rows,
    }


def table(win: dict[str, Any]) -> str:
    rows = win["results"]
    base = next((r for r in rows if r["name"] == "gpu-only"), None)
    head = (
        f"{'config':12} {'hit %':>6} {'of unbounded':>12} {'host %':>6} {'storage %':>9} "
        f"{'TTFT p50':>8} {'vs gpu-only':>11} {'p99':>6} {'goodput':>12} {'TPOT p99':>8} "
        f"{'writes':>8} {'fetches':>8} {'declined':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p50 = r["ttft_s"]["p50"]
        vs = f"{100 * (p50 / base['ttft_s']['p50'] - 1):+.0f} %" if base and p50 else "-"
        good = f"{r['goodput_rps']:.2f} ({100 * r['goodput_frac']:.0f}%)"
        lines.append(
            f"{r['name']:12} {100 * r['prefix_hit_rate']:>6.1f} "
            f"{100 * (r['hit_of_unbounded'] or 0):>11.0f}% "
            f"{100 * r.get('host_hit_rate', 0.0):>6.1f} {100 * r.get('storage_hit_rate', 0.0):>9.1f} "
            f"{p50:>8.2f} {vs:>11} {r['ttft_s']['p99']:>6.1f} {good:>12} "
            f"{1e3 * r['tpot_s']['p99']:>6.0f}ms {r.get('storage_writes', 0):>8} "
            f"{r.get('storage_fetches', 0):>8} {r.get('storage_fetches_declined', 0):>8}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--windows", default=DEFAULT_WINDOWS, help="START-END,... in trace seconds")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO_TTFT_S, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO_TPOT_S, help="seconds")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    windows = parse_windows(args.windows)
    t0 = time.perf_counter()
    everything = load_trace(args.trace, duration_s=max(end for _, end in windows))
    last = max((r.arrival_s for r in everything), default=0.0)
    out: dict[str, Any] = {
        "trace": str(args.trace),
        "instances": args.instances,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "windows": {},
    }
    for start, end in windows:
        if start > last:
            print(f"window {start:g}-{end:g} s: past the trace's end ({last:.0f} s); skipped")
            continue
        reqs = window(everything, start, end)
        print(f"window {start:g}-{end:g} s: {len(reqs)} requests", flush=True)
        win = run_window(reqs, names, args)
        print(
            f"est. utilisation {100 * win['est_utilisation']:.0f} %; ideal LRU hit rate: "
            f"{100 * win['ideal_unbounded']:.1f} % unbounded, {100 * win['ideal_gpu_host']:.1f} % "
            f"with GPU + {HOST_FACTOR}x host blocks of all instances; share of a request's "
            "prompt an unbounded cache holds: p25 {p25:.0%}, p50 {p50:.0%}, p75 {p75:.0%}".format(
                **win["cacheable_share"]
            )
        )
        print(table(win))
        print()
        out["windows"][f"{start:g}-{end:g}"] = win
    out["wall_s"] = time.perf_counter() - t0
    write_json(args.json, out)


if __name__ == "__main__":
    main()
