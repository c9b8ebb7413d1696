"""The KV tiers through the simulator and through the product, request by request (issue 37).

    python -m bench.tier_compare [--trace PATH] [--window 0-120] [--configs gpu-only,host-4x]
                                 [--instances 4] [--sim-only] [--json OUT]

One window of the Mooncake conversation trace (arrivals shifted to start at 0), served twice
per configuration with the same sizes, cost model and arrival times: **sim** is
`bench.simulate` (virtual time, the core's Router and Schedulers, real WorkerEngines over the
SimExecutor) configured as the daemon configures an instance (`EngineConfig()` with the sizes
the workers announce: 64-token blocks, 5,120 GPU blocks, the host blocks; one StorageIndex);
**replay** is `kvsched replay --embedded` (a real `kvsched serve`, N sim worker processes,
real time, requests over gRPC; per request the daemon's OTLP span, collected here).

Configurations: gpu-only (no host tier), host-4x (4x the GPU blocks of host memory,
write_back), storage (host-4x + the storage tier, `--storage mooncake`, the daemon's default
write policy, no prefetch; the sim workers simulate the store at 12.5 GB/s), storage-pf
(storage -> host prefetch), -nohold (never wait for a prefetch), -arrival (prefetch at arrival);
-ahead: swap-ins and fetches a message ahead of the first chunk (`swap_in_ahead`).

Per request: hit tokens, their tier (GPU / host / storage), queue time (arrival to first
placement) and TTFT; per configuration the two runs side by side, the per-request differences
and the share of storage hits prefetched before placement. The load average before and after
each replay is recorded with it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

from bench.policies import BLOCK_SIZE, DEFAULT_TRACE, HOST_FACTOR, NUM_GPU_BLOCKS
from bench.simulate import KvschedCluster, simulate
from bench.spans import traced_cluster
from bench.storage import window
from bench.tier_stats import iqm
from bench.tier_table import table
from kvsched.core import EngineConfig
from kvsched.replay.runner import replay
from kvsched.replay.summary import DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S, summarize
from kvsched.traces import TraceRequest, ideal_lru_hit_rate, load_trace

DEFAULT_JSON = Path(__file__).parent / "results" / "tier_compare.json"
HOST, PF = HOST_FACTOR * NUM_GPU_BLOCKS, {"storage_prefetch": True}
CONFIGS: dict[str, tuple[int, bool, dict[str, Any]]] = {  # host blocks, storage, engine.cache
    "gpu-only": (0, False, {}),
    "host-4x": (HOST, False, {}),
    "storage": (HOST, True, {}),
    "storage-pf": (HOST, True, PF),
    "storage-nohold": (HOST, True, {**PF, "storage_prefetch_hold_ms": 0}),
    "storage-arrival": (HOST, True, {**PF, "storage_prefetch_at_arrival": True}),
    # Swap-ins and fetches a message ahead of the first chunk when they take >= 1/4 of a step.
    "host-4x-ahead": (HOST, False, {"swap_in_ahead": 0.25}),
    "storage-ahead": (HOST, True, {"swap_in_ahead": 0.25}),
    "storage-arrival-ahead": (
        HOST,
        True,
        {**PF, "storage_prefetch_at_arrival": True, "swap_in_ahead": 0.25},
    ),
}
WORKER_STATS = re.compile(
    r"worker stats: (\d+) steps, .* busy ([0-9.]+) s, idle [0-9.]+ s \(([0-9.]+) s waiting"
)
Row = dict[str, Any]  # per request: hit, host, storage tokens, queue s, TTFT s (None: none)


def window_of(trace: Path | str, span: str) -> list[TraceRequest]:
    """The trace's requests arriving in `span` ("START-END" seconds), re-timed from START."""
    start, end = map(float, span.split("-", 1))
    return window(load_trace(trace, duration_s=end), start, end)


def daemon_config(host_blocks: int, cache: dict[str, Any]) -> EngineConfig:
    """What the daemon gives an instance whose workers announce these sizes."""
    cfg = EngineConfig()
    cfg.cache = dataclasses.replace(cfg.cache, **cache)
    cfg.cache.block_size = BLOCK_SIZE
    cfg.cache.num_gpu_blocks = NUM_GPU_BLOCKS
    cfg.cache.num_host_blocks = host_blocks
    return cfg


# ---- the simulator ---------------------------------------------------------------------------
def run_sim(
    reqs: list[TraceRequest],
    name: str,
    instances: int,
    speed: float = 1.0,
    extra_ms: float = 0,
    control_latency_s: float = 0.0,
) -> tuple[list[Row], Any]:
    """speed < 1: every step (and copy) takes 1/speed as long, as on a slower GPU (the sim
    worker's --speed); extra_ms: every step takes that much longer (a fixed cost per step, as
    a loaded machine's CPU adds to a real-time replay's steps); control_latency_s: each Tasks
    message reaches its worker that much after schedule() (`bench.simulate`)."""
    host_blocks, storage, cache = CONFIGS[name]
    seen: dict[str, Any] = {}
    made: list[KvschedCluster] = []

    def make(loop: Any) -> KvschedCluster:
        cfg = daemon_config(host_blocks, cache)
        cluster = KvschedCluster(
            loop,
            cfg,
            num_instances=instances,
            name=name,
            storage=storage,
            control_latency_s=control_latency_s,
        )
        made.append(cluster)
        for inst in cluster.instances:  # keep each finished Request (its tier split, times)
            sim = inst.worker.executor
            sim.speed = speed  # type: ignore[attr-defined]
            if extra_ms:
                execute = sim.execute

                def slower(work: Any, execute: Any = execute) -> Any:
                    result = execute(work)
                    if result.step_time_s > 0:
                        result.step_time_s += extra_ms / 1e3
                    return result

                sim.execute = slower  # type: ignore[method-assign]
            on_events = inst._on_events

            def keep(ev: Any, on_events: Any = on_events) -> None:
                for req in ev.finished:
                    seen[req.req_id] = req
                on_events(ev)

            inst._on_events = keep  # type: ignore[method-assign]
        return cluster

    res = simulate(reqs, make)
    steps = {
        "steps": sum(i.num_steps for i in res.instances),
        "busy_s": sum(i.busy_s for i in res.instances),
        "waiting_on_daemon_s": sum(i.idle_control_plane_s for i in res.instances),
    }
    rows = []
    for rec in res.records:
        req = seen.get(rec.req_id)
        rows.append(
            {
                "hit": rec.num_cached_tokens,
                "host": req.num_host_cached_tokens if req else 0,
                "storage": req.num_storage_cached_tokens if req else 0,
                "queue_s": req.first_scheduled_time - req.arrival_time if req else None,
                "ttft_s": rec.ttft_s,
                "instance": rec.instance,
            }
        )
    summary = res.summary(slo_ttft_s=DEFAULT_SLO_TTFT_S, slo_tpot_s=DEFAULT_SLO_TPOT_S)
    snaps = [i.sched.snapshot() for c in made for i in c.instances]
    stored = sum(x.prefix_cache_storage_hit_tokens for x in snaps)
    pf = sum(x.prefix_cache_prefetched_hit_tokens for x in snaps) / stored if stored else 0.0
    return rows, {**summary, "worker_steps": steps, "storage_prefetched_frac": pf}


def run_replay(
    reqs: list[TraceRequest], name: str, instances: int, streams: int = 1
) -> tuple[list[Row], dict[str, Any], dict[str, Any]]:
    host_blocks, storage, cache = CONFIGS[name]
    load = {"before": os.getloadavg()}
    sink, server, cluster = traced_cluster(
        instances,
        {f"KVSCHED_ENGINE__CACHE__{k.upper()}": str(v) for k, v in cache.items()},
        num_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        host_blocks=host_blocks,
        serve_args=("--storage", "mooncake") if storage else (),
    )
    try:
        result = asyncio.run(replay(cluster.address, reqs, progress=False, streams=streams))
        complete = sink.wait_for(len(reqs), 30.0)
    finally:
        cluster.stop()
        server.stop(None)
    steps = {"steps": 0, "busy_s": 0.0, "waiting_on_daemon_s": 0.0}
    for w in cluster.workers:  # each worker's last line of stats (wall time: the box's)
        for line in reversed(w.lines):
            if m := WORKER_STATS.search(line):
                steps["steps"] += int(m.group(1))
                steps["busy_s"] += float(m.group(2))
                steps["waiting_on_daemon_s"] += float(m.group(3))
                break
    load["after"] = os.getloadavg()
    if not complete:
        print(f"  replay {name}: {len(sink.spans)} of {len(reqs)} spans arrived")
    rows, t0 = [], result.t0_wall_ns
    for rec in result.records:
        sp = sink.spans.get(rec.req_id, {})
        rows.append(
            {
                "hit": rec.num_cached_tokens,
                "host": int(sp.get("kvsched.host_cached_tokens", 0)),
                "storage": int(sp.get("kvsched.storage_cached_tokens", 0)),
                "queue_s": sp.get("kvsched.queue_time_s"),
                "ttft_s": rec.ttft_s,
                "daemon_ttft_s": sp.get("kvsched.ttft_s"),  # arrival to first token, daemon's
                # the client's send to the daemon's arrival; the daemon's first token to the
                # client's (wall clock, one host)
                "client_late_s": None if rec.sent_s is None else rec.sent_s - rec.arrival_s,
                "send_s": _since(sp.get("arrival_ns"), t0) - rec.arrival_s if t0 else None,
                "deliver_s": (rec.first_token_s or 0) - _since(sp.get("first_token_ns"), t0)
                if rec.first_token_s is not None and sp.get("first_token_ns")
                else None,
                "instance": sp.get("kvsched.instance"),
            }
        )
    num_prompt = sum(r.num_prompt_tokens for r in result.records if r.completed)
    summary = summarize(
        result.records,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        preemptions=result.preemptions,
        slo_ttft_s=DEFAULT_SLO_TTFT_S,
        slo_tpot_s=DEFAULT_SLO_TPOT_S,
        host_hit_rate=result.host_hit_tokens / num_prompt if num_prompt else 0.0,
        storage_hit_rate=result.storage_hit_tokens / num_prompt if num_prompt else 0.0,
        storage_prefetched_frac=result.prefetched_hit_tokens / max(1, result.storage_hit_tokens),
        worker_steps=steps,
    )
    return rows, summary, load


def _since(ns: int | None, t0_ns: int) -> float:
    return (ns - t0_ns) / 1e9 if ns else float("nan")


def jittered(reqs: list[TraceRequest], seed: int) -> list[TraceRequest]:
    """The requests with every arrival moved by up to +-1 ms (uniform, seeded), in order."""
    rng = random.Random(seed)
    moved = [
        dataclasses.replace(r, arrival_s=max(0.0, r.arrival_s + rng.uniform(-1e-3, 1e-3)))
        for r in reqs
    ]
    moved.sort(key=lambda r: r.arrival_s)
    return moved


def jitter_spread(
    reqs: list[TraceRequest], name: str, instances: int, seeds: int
) -> dict[str, Any]:
    """The sim's own spread: TTFT p50 and goodput when every arrival moves by up to +-1 ms
    (uniform, seeded): a difference smaller than this the trace cannot tell apart."""
    p50s, goodputs = [], []
    for seed in range(seeds):
        _, summary = run_sim(jittered(reqs, seed), name, instances)
        p50s.append(summary["ttft_s"]["p50"])
        goodputs.append(summary["goodput_rps"])
    return {"ttft_p50": p50s, "goodput_rps": goodputs}


# ---- the comparison --------------------------------------------------------------------------
def _q(xs: list[float], f: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else None


def aggregate(rows: list[Row], prompt: list[int]) -> dict[str, Any]:
    total = sum(prompt) or 1
    queue = [r["queue_s"] for r in rows if r["queue_s"] is not None]
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    service = [
        r["ttft_s"] - r["queue_s"]
        for r in rows
        if r["ttft_s"] is not None and r["queue_s"] is not None
    ]
    return {
        "hit": sum(r["hit"] for r in rows) / total,
        "host": sum(r["host"] for r in rows) / total,
        "storage": sum(r["storage"] for r in rows) / total,
        "queue_p50": _q(queue, 0.5),
        "queue_mean": statistics.fmean(queue) if queue else None,
        "service_p50": _q(service, 0.5),
        "ttft_p50": _q(ttft, 0.5),
        "ttft_iqm": iqm(ttft),
        "ttft_p90": _q(ttft, 0.9),
    }


def differences(sim: list[Row], rep: list[Row]) -> dict[str, Any]:
    """Per request, replay minus sim."""
    pairs = [(s, r) for s, r in zip(sim, rep, strict=True)]
    d_ttft = [r["ttft_s"] - s["ttft_s"] for s, r in pairs if r["ttft_s"] and s["ttft_s"]]
    d_queue = [
        r["queue_s"] - s["queue_s"]
        for s, r in pairs
        if r["queue_s"] is not None and s["queue_s"] is not None
    ]
    return {
        "same_hit_tokens": sum(s["hit"] == r["hit"] for s, r in pairs) / max(1, len(pairs)),
        "hit_tokens_replay_minus_sim": sum(r["hit"] - s["hit"] for s, r in pairs),
        "ttft_diff_p50": _q(d_ttft, 0.5),
        "ttft_diff_p10": _q(d_ttft, 0.1),
        "ttft_diff_p90": _q(d_ttft, 0.9),
        "queue_diff_p50": _q(d_queue, 0.5),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--window", default="0-120", help="START-END in trace seconds")
    ap.add_argument("--configs", default="gpu-only,host-4x", help=f"from {list(CONFIGS)}")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--sim-only", action="store_true", help="no replay (quick)")
    ap.add_argument(
        "--sim-speed",
        type=float,
        default=1.0,
        help="the sim's steps take 1/S as long (S < 1: a slower GPU; default 1)",
    )
    ap.add_argument(
        "--sim-step-extra-ms",
        type=float,
        default=0.0,
        help="every sim step takes this much longer (a loaded box's fixed cost per real step)",
    )
    ap.add_argument(
        "--jitter-seeds",
        type=int,
        default=0,
        metavar="N",
        help="also run the sim N times with arrivals moved by up to +-1 ms (its own spread)",
    )
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    reqs = window_of(args.trace, args.window)
    prompt = [len(r.prompt_token_ids) for r in reqs]
    out: dict[str, Any] = {
        "trace": str(args.trace),
        "window": args.window,
        "num_requests": len(reqs),
        "instances": args.instances,
        "ideal_unbounded": ideal_lru_hit_rate(reqs, None, BLOCK_SIZE),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "sim_speed": args.sim_speed,
        "sim_step_extra_ms": args.sim_step_extra_ms,
        "configs": {},
    }
    print(f"window {args.window} s: {len(reqs)} requests", flush=True)
    for name in names:
        c: dict[str, Any] = {}
        rows, summary = run_sim(reqs, name, args.instances, args.sim_speed, args.sim_step_extra_ms)
        c["sim"] = {"agg": aggregate(rows, prompt), "summary": summary, "rows": rows}
        if not args.sim_only:
            t0 = time.perf_counter()
            rrows, rsummary, load = run_replay(reqs, name, args.instances)
            c["replay"] = {"agg": aggregate(rrows, prompt), "summary": rsummary, "rows": rrows}
            c["replay"]["load_avg"] = load
            c["replay"]["wall_s"] = time.perf_counter() - t0
            c["diff"] = differences(rows, rrows)
            print(f"  {name}: replay {c['replay']['wall_s']:.0f} s, load {load}", flush=True)
        if args.jitter_seeds:
            c["sim_jitter"] = j = jitter_spread(reqs, name, args.instances, args.jitter_seeds)
            print(f"  {name}: sim TTFT p50 with arrivals +-1 ms: {sorted(j['ttft_p50'])}")
        out["configs"][name] = c
    print(table(out))
    for c in out["configs"].values():  # per-request rows as columns: a small file
        for run in ("sim", "replay"):
            if run in c:
                rows = c[run]["rows"]
                c[run]["rows"] = {
                    k: [_round(r[k]) for r in rows] for k in (rows[0] if rows else {})
                }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.json}")


def _round(v: Any) -> Any:  # 5 digits
    return round(v, 5) if isinstance(v, float) else v


if __name__ == "__main__":
    main()
