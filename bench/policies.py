"""The same trace through several configurations of kvsched's scheduler on simulated H100s.

    python -m bench.policies [--trace PATH] [--duration S] [--instances N] [--rate-scale X]
                             [--configs a,b] [--slo-ttft S] [--slo-tpot S] [--json OUT]

Each configuration serves the trace in `bench.simulate` (virtual time, the asynchronous worker
protocol, the H100 cost model) on N instances behind kvsched's Router. Per instance: Llama-3-8B
with ~40 GiB of KV = 5,120 blocks of 64 tokens, 256 slots, 8,192 tokens per step.

    default             kvsched's defaults (a prompt is admitted only when all of it fits beside
                        the prompts already admitted; no admission reserve; LIFO recompute)
    chunk-admission     default, but admitting a prompt when its first chunk fits (as the seed
                        and vLLM before scheduler_reserve_full_isl do)
    seed                FastDeploy's heuristics (resource_manager_v1): admission reserve of 16
                        blocks per running request, decaying 0.025 per scheduled step down to 0
                        (FastDeploy's FD_RESERVE_*_OUTPUT_BLOCK_NUM_FOR_DECODE_WHEN_SCHEDULE_NEW_
                        PREFILL env defaults 16 / 0.025 / 0), decode prealloc 2 blocks at <= 12
                        free slots (enc_dec_block_num / prealloc_dec_block_slot_num_threshold),
                        LIFO recompute, chunk admission
    no-prefix-cache     default without prefix caching
    no-chunked-prefill  default admitting whole prompts only (budget = max_model_len, as
                        the config requires, so a step may carry a 126k-token prompt)
    no-itl-target       default without the time budget (itl_target_ms = 0): only the token
                        budget bounds a worker step
    seed-x2             default with the daemon's step-cost model seeded at twice the sim's
                        coefficients: it must learn the real ones from the reports
    host-4x             default with a host-memory KV tier of 4x the GPU blocks per instance
                        (20,480 blocks, 160 GiB of host memory), write_through_selective after
                        one hit (the default policy); the sim prices each copy at 8 MiB over
                        50 GB/s of PCIe (~0.17 ms) on the step's critical path
    host-4x-write-back  host-4x, copying a block to host when the GPU pool evicts it
    host-4x-write-through  host-4x, copying every block once it is full and registered

Defaults: the first 300 s of the Mooncake conversation trace (918 requests) on 4 instances,
about 80 % utilisation by the cost model (printed). It also prints the prefix-hit rate an ideal
LRU cache would reach on the same requests (`kvsched.traces.ideal_lru_hit_rate`) with the same
total number of blocks, and ours as a fraction of it. Writes bench/results/policies.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.simulate import KvschedCluster, offered_work_s, simulate
from kvsched.core import CacheConfig, EngineConfig, SchedulerConfig
from kvsched.core.config import WritePolicy
from kvsched.data import CONVERSATION_SLICE
from kvsched.replay.summary import DEFAULT_SLO_TPOT_S, DEFAULT_SLO_TTFT_S
from kvsched.traces import TraceRequest, ideal_lru_hit_rate, load_trace


def full_trace_or_slice() -> Path:
    """The full conversation trace where the folder in KVSCHED_TRACE_DIR holds it, else the
    shipped slice: its first 300 s, byte for byte, so the default --duration replays the same
    requests either way."""
    folder = os.environ.get("KVSCHED_TRACE_DIR")
    full = Path(folder) / "mooncake_conversation.jsonl" if folder else None
    return full if full is not None and full.exists() else CONVERSATION_SLICE


DEFAULT_TRACE = full_trace_or_slice()
DEFAULT_JSON = Path(__file__).parent / "results" / "policies.json"
BLOCK_SIZE = 64
NUM_GPU_BLOCKS = 5120  # Llama-3-8B: 8 MiB per 64-token block, 40 GiB of KV on an H100
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
MAX_MODEL_LEN = 131072


def base_config() -> EngineConfig:
    """One H100 instance serving Llama-3-8B, with kvsched's default policies."""
    return EngineConfig(
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_GPU_BLOCKS),
        scheduler=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN,
        ),
    )


def seed_config() -> EngineConfig:
    cfg = base_config()
    cfg.cache.reserve_blocks = 16
    cfg.cache.reserve_decay = 0.025
    cfg.cache.reserve_min = 0
    cfg.cache.prealloc_blocks = 2
    cfg.cache.prealloc_threshold = 12
    cfg.scheduler.admit_full_prompt = False  # the seed admits when the first chunk fits
    return cfg  # victims: LIFO recompute, kvsched's only policy under fcfs


def chunk_admission_config() -> EngineConfig:
    cfg = base_config()
    cfg.scheduler.admit_full_prompt = False
    return cfg


def no_prefix_cache_config() -> EngineConfig:
    cfg = base_config()
    cfg.cache.enable_prefix_caching = False
    return cfg


def no_chunked_prefill_config() -> EngineConfig:
    cfg = base_config()
    cfg.scheduler.disable_chunked_prefill = True
    cfg.scheduler.max_num_batched_tokens = cfg.scheduler.max_model_len
    return cfg


def no_itl_target_config() -> EngineConfig:
    cfg = base_config()
    cfg.scheduler.itl_target_ms = 0.0
    return cfg


def seed_x2_config() -> EngineConfig:
    cfg = base_config()
    sc = cfg.step_cost
    sc.intercept_ms *= 2
    sc.per_prefill_token_ms *= 2
    sc.per_decode_ms *= 2
    sc.per_decode_context_ms *= 2
    sc.per_attention_ms *= 2
    return cfg


HOST_FACTOR = 4  # host blocks per GPU block in the host-4x configurations


def host_config(policy: str = "write_through_selective") -> EngineConfig:
    cfg = base_config()
    cfg.cache.num_host_blocks = HOST_FACTOR * NUM_GPU_BLOCKS
    cfg.cache.host_write_policy = WritePolicy(policy)
    # A 64-token block is 8 MiB: ~0.17 ms at 50 GB/s (the model learns it from the steps).
    cfg.step_cost.per_swapped_block_ms = 0.17
    return cfg


CONFIGS: dict[str, Callable[[], EngineConfig]] = {
    "default": base_config,
    "chunk-admission": chunk_admission_config,
    "seed": seed_config,
    "no-prefix-cache": no_prefix_cache_config,
    "no-chunked-prefill": no_chunked_prefill_config,
    "no-itl-target": no_itl_target_config,
    "seed-x2": seed_x2_config,
    "host-4x": host_config,
    "host-4x-write-back": lambda: host_config("write_back"),
    "host-4x-write-through": lambda: host_config("write_through"),
}


def add_run_args(ap: argparse.ArgumentParser, default_json: Path) -> None:
    """The flags bench.policies and bench.peers share."""
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--duration", type=float, default=300.0, help="trace seconds to replay")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier")
    ap.add_argument("--gpu", default="h100", choices=["h100", "a100"])
    ap.add_argument("--slo-ttft", type=float, default=DEFAULT_SLO_TTFT_S, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=DEFAULT_SLO_TPOT_S, help="seconds")
    ap.add_argument(
        "--control-latency",
        type=float,
        default=0.0,
        help="virtual seconds from a report (or arrival) to its Tasks reaching the worker",
    )
    ap.add_argument("--json", type=Path, default=default_json)


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    requests = load_trace(args.trace, duration_s=args.duration)
    # The trace's token lists live for the whole run: keep the collector off them, as
    # vLLM's engine freezes its startup heap.
    gc.collect()
    gc.freeze()
    return requests


def describe_load(
    requests: list[TraceRequest], args: argparse.Namespace
) -> tuple[dict[str, Any], list[str]]:
    """Run metadata and the header lines that say what is being served."""
    span = args.duration / args.rate_scale
    work = offered_work_s(requests, args.gpu, MAX_NUM_BATCHED_TOKENS)
    util = work / (span * args.instances)
    meta = {
        "trace": str(args.trace),
        "duration_s": args.duration,
        "rate_scale": args.rate_scale,
        "instances": args.instances,
        "gpu": args.gpu,
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "offered_work_gpu_s": work,
        "est_utilisation": util,
        "control_latency_s": args.control_latency,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}",
    }
    lines = [
        f"trace {args.trace.name}: first {args.duration:g} s, {len(requests)} requests, "
        f"rate x{args.rate_scale:g}, {args.instances} x {args.gpu.upper()} "
        f"({NUM_GPU_BLOCKS} blocks of {BLOCK_SIZE} tokens each)",
        f"offered work {work:.0f} GPU-s by the cost model (no prefix hits) over "
        f"{span:.0f} s: est. utilisation {100 * util:.0f} %",
    ]
    return meta, lines


def ideal_bounds(requests: list[TraceRequest], instances: int) -> dict[str, float]:
    return {
        "total_blocks": ideal_lru_hit_rate(requests, NUM_GPU_BLOCKS * instances, BLOCK_SIZE),
        "one_instance_blocks": ideal_lru_hit_rate(requests, NUM_GPU_BLOCKS, BLOCK_SIZE),
        "unbounded": ideal_lru_hit_rate(requests, None, BLOCK_SIZE),
        # The same bound with each instance's host tier added to its blocks (host-4x rows).
        "total_with_host": ideal_lru_hit_rate(
            requests, (1 + HOST_FACTOR) * NUM_GPU_BLOCKS * instances, BLOCK_SIZE
        ),
    }


def run_kvsched(
    requests: list[TraceRequest], name: str, config: EngineConfig, args: argparse.Namespace
) -> dict[str, Any]:
    factory = KvschedCluster.factory(
        config,
        num_instances=args.instances,
        gpu=args.gpu,
        control_latency_s=args.control_latency,
        name=name,
    )
    result = simulate(requests, factory, rate_scale=args.rate_scale)
    out = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    out["config"] = _config_dict(config)
    return out


def _config_dict(config: EngineConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)  # enums are StrEnums: plain strings in JSON


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _tok(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]], ideal: float | None = None) -> str:
    """One line per run: goodput, TTFT, TPOT, hit rate, preemptions, throughput, CPU."""
    head = (
        f"{'config':20} {'goodput':>12} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>6} "
        f"{'ITL p99':>7} {'prefill/step p99':>16} {'max':>6} "
        f"{'hit %':>6} {'of ideal':>8} {'preempt':>7} {'tok/s':>6} {'sched us/step':>15}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        good = f"{r['goodput_rps']:.2f} ({100 * r['goodput_frac']:.0f}%)"
        hit = r["prefix_hit_rate"]
        bound = r.get("ideal_bound", ideal)
        of_ideal = f"{100 * hit / bound:.0f} %" if bound else "-"
        cpu = r["scheduler_cpu_us_per_step"]
        pf = r.get("prefill_tokens_per_step") or {"p99": None, "max": None}
        cpu_s = f"{cpu['mean']:.0f} / p99 {cpu['p99']:.0f}" if cpu["mean"] is not None else "-"
        lines.append(
            f"{r['name']:20} {good:>12} {_s(r['ttft_s']['p50']):>9} {_s(r['ttft_s']['p99']):>7} "
            f"{_ms(r['tpot_s']['p50']):>7}ms {_ms(r['tpot_s']['p99']):>4}ms "
            f"{_ms(r['itl_s']['p99']):>5}ms {_tok(pf['p99']):>16} {_tok(pf['max']):>6} "
            f"{100 * hit:>6.1f} {of_ideal:>8} {r['preemptions']:>7} "
            f"{r['output_tokens_per_s']:>6.0f} {cpu_s:>15}"
        )
    return "\n".join(lines)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, DEFAULT_JSON)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {list(CONFIGS)}")
    ap.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="every config's scheduler.itl_target_ms (default: each config's own, 100; 0: off)",
    )
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")

    t0 = time.perf_counter()
    requests = load_requests(args)
    meta, header = describe_load(requests, args)
    bounds = ideal_bounds(requests, args.instances)
    header.append(
        "ideal LRU prefix-hit rate: {:.1%} with all {} blocks, {:.1%} with one instance's, "
        "{:.1%} unbounded; {:.1%} with GPU + {}x host blocks (host-4x rows)".format(
            bounds["total_blocks"],
            NUM_GPU_BLOCKS * args.instances,
            bounds["one_instance_blocks"],
            bounds["unbounded"],
            bounds["total_with_host"],
            HOST_FACTOR,
        )
    )
    print("\n".join(header), flush=True)
    rows = []
    for name in names:
        config = CONFIGS[name]()
        if args.itl_target_ms is not None:
            config.scheduler.itl_target_ms = args.itl_target_ms
        row = run_kvsched(requests, name, config, args)
        bound = bounds["total_with_host" if config.cache.num_host_blocks else "total_blocks"]
        row["ideal_bound"] = bound
        row["hit_rate_of_ideal"] = row["prefix_hit_rate"] / bound if bound else None
        rows.append(row)
        print(f"  {name}: {row['sim_wall_s']:.1f} s", flush=True)
    print()
    print(table(rows, bounds["total_blocks"]))
    print(
        f"(goodput: req/s with TTFT <= {args.slo_ttft:g} s and TPOT <= "
        f"{1e3 * args.slo_tpot:g} ms, share of requests in brackets; prefill/step: prompt "
        f"tokens in an executed worker step with prefill; sched: real CPU of "
        f"apply_report + schedule per worker step, mean / p99 over calls)"
    )
    meta.update(ideal_lru_hit_rate=bounds, wall_s=time.perf_counter() - t0)
    write_json(args.json, {**meta, "results": rows})


if __name__ == "__main__":
    main()
