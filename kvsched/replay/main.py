"""`kvsched replay` and `kvsched demo`: load a trace, replay it, print and save the summary."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvsched.replay.args import BLOCK_SIZE
from kvsched.replay.launch import start_cluster
from kvsched.replay.runner import ReplayResult, replay
from kvsched.replay.summary import summarize
from kvsched.tls import channel_credentials
from kvsched.traces import load_trace


def run_replay(args: argparse.Namespace) -> int:
    requests = load_trace(args.trace, duration_s=args.duration, max_requests=args.requests)
    if not requests:
        print(f"kvsched replay: no requests in {args.trace} for that duration", file=sys.stderr)
        return 2
    if args.streams < 1:
        print(f"kvsched replay: --streams {args.streams}: at least 1", file=sys.stderr)
        return 2
    creds = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)  # before any launch
    cluster = None
    address = args.server
    if args.embedded:
        cluster = start_cluster(
            args.workers,
            gpu=args.gpu,
            speed=args.time_scale,
            num_blocks=args.num_blocks,
            block_size=BLOCK_SIZE,
            host_blocks=args.host_blocks,
            serve_args=serve_args(args),
            num_daemons=args.daemons,
        )
        address = cluster.address
    from kvsched.client import KvschedClientError

    try:
        result = asyncio.run(
            replay(
                address,
                requests,
                rate_scale=args.rate_scale,
                time_scale=args.time_scale,
                progress=not args.no_progress,
                token=args.token,
                credentials=creds,
                admin_token=args.admin_token or None,
                streams=args.streams,
            )
        )
    except KvschedClientError as exc:  # refused (credentials, TLS) or unreachable
        print(f"kvsched replay: {address}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except Exception as exc:  # a refused stream still being written (grpc/grpc#36066), ...
        # One line, not a traceback: under load a refusal has surfaced as an error that is
        # not a typed client error (seen once in CI's run of the mutual-TLS replay test).
        print(f"kvsched replay: {address}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        idle = cluster.stop() if cluster else {}
    if args.embedded and not result.block_size:  # status not readable: the size we gave
        result.block_size = BLOCK_SIZE
    summary = make_summary(result, args, idle)
    print(format_table(summary))
    if getattr(args, "explain", False):
        print(EXPLAIN)
    if summary["not_completed"]:
        print(format_not_completed(summary["not_completed"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        from kvsched.replay.plots import write_plots

        plots = write_plots(result, args.json.with_suffix(""), summary)
        print(f"wrote {args.json}" + "".join(f", {p}" for p in plots))
        if plots and getattr(args, "explain", False):
            print(EXPLAIN_PLOTS)
        if not plots:
            print("(no plots: they need matplotlib, pip install 'kvsched[bench]')")
    if summary["completed"] != summary["requests"]:
        missing = summary["requests"] - summary["completed"]
        print(
            f"kvsched replay: {missing} of {summary['requests']} requests did not complete "
            f"({_outcomes(summary['not_completed'])}; listed above)",
            file=sys.stderr,
        )
        return 1
    return 0


def not_completed(result: ReplayResult) -> list[dict[str, Any]]:
    """Every request that did not complete: its id, size, how it ended and why."""
    unfit = dict(result.unfit)
    out = []
    for r in result.records:
        if r.completed:
            continue
        row: dict[str, Any] = {
            "request_id": r.req_id,
            "prompt_tokens": r.num_prompt_tokens,
            "max_tokens": r.max_tokens,
            "outcome": {"rejected": "refused", "": "unfinished"}.get(
                r.finish_reason, r.finish_reason
            ),
            "reason": r.message,
        }
        if r.req_id in unfit:
            row["kv_blocks_needed"] = unfit[r.req_id]
        out.append(row)
    return out


def _outcomes(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def format_not_completed(rows: list[dict[str, Any]], limit: int = 20) -> str:
    lines = [f"not completed ({len(rows)}):"]
    for row in rows[:limit]:
        why = row["reason"] or "no reason given (the stream ended first)"
        lines.append(
            f"  {row['request_id']}  {row['prompt_tokens']:,} prompt tokens  "
            f"{row['outcome']}: {why}"
        )
    if len(rows) > limit:
        lines.append(f"  ... and {len(rows) - limit} more (all in the JSON's not_completed)")
    return "\n".join(lines)


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The embedded daemon's flags from replay's."""
    out: tuple[str, ...] = ()
    if args.itl_target_ms is not None:
        out += ("--itl-target-ms", f"{args.itl_target_ms:g}")
    if getattr(args, "host_write_policy", None):
        out += ("--host-write-policy", args.host_write_policy)
    if getattr(args, "storage", None):
        out += ("--storage", args.storage)
    return out


def make_summary(
    result: ReplayResult, args: argparse.Namespace, idle: dict[str, float]
) -> dict[str, Any]:
    num_prompt = sum(r.num_prompt_tokens for r in result.records if r.completed)
    return summarize(
        result.records,
        num_gpu_blocks=result.num_gpu_blocks,
        block_size=result.block_size,
        preemptions=result.preemptions,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        trace=str(args.trace),
        instances=result.instances,
        worker_idle_frac_control_plane=max(idle.values()) if idle else None,
        time_scale=args.time_scale,
        rate_scale=args.rate_scale,
        num_host_blocks=result.num_host_blocks,
        host_hit_rate=result.host_hit_tokens / num_prompt if num_prompt else 0.0,
        storage_hit_rate=result.storage_hit_tokens / num_prompt if num_prompt else 0.0,
        storage_prefetched_frac=(
            result.prefetched_hit_tokens / result.storage_hit_tokens
            if result.storage_hit_tokens
            else 0.0
        ),
        not_completed=not_completed(result),
        config={
            "embedded": bool(args.embedded),
            "gpu": args.gpu if args.embedded else "",
            "workers": args.workers if args.embedded else len(result.instances),
            "daemons": max(len(result.daemons), 1),
        },
    )


EXPLAIN = """\
what the figures mean (times are simulated GPU seconds, as if the run took real time):
  requests (completed)          requests sent; completed = ended by EOS/stop or max_tokens
  output tokens/s               output tokens of all workers per second, first arrival to last finish
  TTFT p50 / p99                time to first token: arrival at the daemon to the first output token
  TPOT p50 / p99                time per output token after the first: the decode speed a request saw
  prefix-cache hit              share of prompt tokens found in KV blocks cached by earlier requests
  of it from host memory        of those, the share swapped in from the workers' host-memory tier
  of it from storage            of those, the share fetched from the shared storage tier (--storage)
  preemptions                   requests evicted from the KV cache to make room, recomputed later
  goodput                       completed requests per second that met both SLOs (and their share)
  worker idle on control plane  the worst worker's share of the time it held requests spent waiting
                                only on the daemon's next decision; 0.00 % = no GPU waited on kvsched\
"""
EXPLAIN_PLOTS = """\
  *_latency_cdf.png: for each latency, the share of requests at or under it (log axes; dashed: SLOs)
  *_timeline.png: requests running and waiting, KV cache used and output tokens/s over the run\
"""


def format_table(s: dict[str, Any]) -> str:
    def ms(d: dict[str, Any], k: str) -> str:
        v = d.get(k)
        return "-" if v is None else f"{1000 * v:,.0f} ms"

    idle = s.get("worker_idle_frac_control_plane")
    rows = [
        ("requests (completed)", f"{s['requests']} ({s['completed']})"),
        ("output tokens/s", f"{s['output_tokens_per_s']:,.0f}"),
        ("TTFT p50 / p99", f"{ms(s['ttft_s'], 'p50')} / {ms(s['ttft_s'], 'p99')}"),
        ("TPOT p50 / p99", f"{ms(s['tpot_s'], 'p50')} / {ms(s['tpot_s'], 'p99')}"),
        ("prefix-cache hit", f"{100 * s['prefix_hit_rate']:.1f} %"),
        (
            "  of it from host memory",
            f"{100 * s.get('host_hit_rate', 0.0):.1f} % ({s.get('num_host_blocks', 0)} host blocks)",
        ),
        (
            "  of it from storage",
            f"{100 * s.get('storage_hit_rate', 0.0):.1f} % "
            f"({100 * s.get('storage_prefetched_frac', 0.0):.0f} % of it prefetched before "
            "placement)",
        ),
        ("preemptions", f"{s['preemptions']}"),
        (
            "goodput",
            f"{s['goodput_rps']:.2f} req/s, {100 * s['goodput_frac']:.0f} % of requests "
            f"(TTFT <= {s['slo_ttft_s']} s, TPOT <= {s['slo_tpot_s']} s)",
        ),
        ("worker idle on control plane", "-" if idle is None else f"{100 * idle:.2f} %"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 36)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])
