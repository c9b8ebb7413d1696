"""Transport benchmark: how many engine steps per second the daemon sustains with every token
streamed to clients, and what each step costs the daemon's CPU.

    python -m bench.transport [--running 256,1024] [--seconds 10] [--tracing none|otlp]
                              [--repeat N] [--sessions N] [--max-tokens N]
                              [--json bench/results/transport.json]

For each R it starts, as child processes, the real daemon (`kvsched serve`), ONE zero-cost sim
worker with R slots, and (with `--tracing otlp`) an OTLP/gRPC sink (`bench.otlp_sink`) the
daemon exports to. This process runs the front end: Session streams that keep exactly R requests
running (distinct short prompts, max_tokens long enough to decode through the whole window, a
new request submitted whenever one finishes). After all R run and a warm-up, one window of
`--seconds` is measured:

    steps_per_s             tokens delivered to the front end / R / window: full steps (each
                            running request one token, streamed to its client) per second
    daemon_cpu_us_per_step  the daemon's utime + stime (/proc/PID/stat, all its threads) over
                            the window / those steps
    tokens_per_s            token events received by the front end / window
    daemon_schedules_per_s  AdminService GetStatus num_steps delta: schedule() calls, about one
                            per worker report. Above steps_per_s when the worker's steps carry
                            fewer than R tokens (slots paused for blocks), below it when the
                            daemon folds several reports into one schedule()

The worker and the front end's CPU per step are recorded too: on a small machine all processes
share the same cores, so the step rate is bounded by their sum, not the daemon's alone. So are
`worker_tokens_per_step` (below R: the worker ran steps with slots paused, waiting for block
extensions) and `other_load_cores` (CPU used by processes outside the benchmark during the
window: the figures only mean something when it is near 0). `--repeat N` runs every case N
times and keeps the run with the median steps/s.

`--tracing otlp` runs every R twice, tracing `none` then `otlp`, in the same invocation, and
prints otlp / none steps/s (target: >= 0.90). With `--repeat N` the none and otlp runs
alternate, and the verdict is the median of the N back-to-back pairs' ratios (drift on a shared
machine hits both runs of a pair alike), printed with each pair's. Tracing costs per request (a span per request,
no span per step or token), so with long requests it measures the idle exporter's overhead;
`--max-tokens` lower makes requests turn over and prices the spans too.

`--hot-path` starts no process: it times, in this process, the daemon's Python work for one
full report (decode, apply_report, notify, schedule, Session batch) at each R. That part of the
daemon's CPU per step, free of gRPC and of the machine's noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.transport_stack import (
    DEFAULT_JSON,
    MAX_TOKENS,
    TARGET_CPU_US_PER_STEP,
    TARGET_STEPS_PER_S,
    TARGET_TRACING_RATIO,
    machine,
    run_case,
)

HOT_STAGES = ("decode report", "apply_report", "notify sinks", "schedule", "Session batch")


async def hot_path(running: int, steps: int) -> dict[str, float]:
    """Median microseconds per step of what the daemon does in Python for one full report (every
    running request one token, all on one Session), in process: the report's bytes decoded
    (FromString + report_from_proto), apply_report, the sinks notified (the token loop of the
    engine's EventDispatch), schedule() + tasks_to_bytes, the Session message built and
    serialized. Steady decode as bench.core_step sets it up. CPU time of this thread, so that
    other processes taking the core do not count. Run inside a loop: sinks hold asyncio objects."""
    from types import SimpleNamespace

    from bench.core_step import Worker, build, warm_up
    from kvsched import codec
    from kvsched.server.requests.delivery import TokenDelivery
    from kvsched.server.requests.frontend import RequestServicer
    from kvsched.server.requests.record import LocalEngine, Tracked
    from kvsched.server.requests.sinks import SessionSink
    from kvsched.v1 import worker_service_pb2 as wpb

    sched = build(running, 0, seed=1)
    worker = Worker(sched)
    warm_up(sched, worker, running)
    sink, engine = SessionSink(), SimpleNamespace(instance_id="i0")
    daemon = SimpleNamespace(tracked={})
    for req in sched.requests.values():
        where = LocalEngine(engine)  # type: ignore[arg-type]
        req.tag = daemon.tracked[req.req_id] = Tracked(req, where, sink)
    # No journal: as a standalone daemon.
    durable = SimpleNamespace(journal=None)
    servicer = RequestServicer(None, None, durable, daemon, 0)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {k: [] for k in HOT_STAGES}
    deliver = TokenDelivery()  # as the engine's EventDispatch holds one
    tasks = sched.schedule()
    for _ in range(steps):
        worker.engine.apply(tasks)
        report = worker.engine.step()  # the reference worker's report, finish reasons included
        assert report is not None
        raw = wpb.ConnectRequest(report=codec.report_to_proto(report)).SerializeToString()
        t0 = time.thread_time()
        core = codec.report_from_proto(wpb.ConnectRequest.FromString(raw).report)
        t1 = time.thread_time()
        events = sched.apply_report(core)
        t2 = time.thread_time()
        deliver(events.tokens)
        t3 = time.thread_time()
        tasks = sched.schedule()
        sched.take_events()
        if not tasks.is_empty():
            codec.tasks_to_bytes(tasks)
        t4 = time.thread_time()
        msg = servicer._batch(sink)
        assert msg is not None
        msg.SerializeToString()
        t5 = time.thread_time()
        for k, a, b in zip(HOT_STAGES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
            times[k].append((b - a) * 1e6)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["total"] = sum(out.values())
    return out


def print_hot_path(sizes: list[int], steps: int) -> None:
    print(f"daemon hot path per full step, in process, no gRPC: median CPU us of {steps} steps")
    print(f"{'running':>7} " + " ".join(f"{k:>14}" for k in (*HOT_STAGES, "total")))
    for n in sizes:
        t = asyncio.run(hot_path(n, steps))
        print(f"{n:>7} " + " ".join(f"{t[k]:>14,.1f}" for k in (*HOT_STAGES, "total")))


# ---- report ---------------------------------------------------------------------------------


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median steps/s, with every run's steps/s alongside."""
    ordered = sorted(runs, key=lambda r: r["steps_per_s"])
    rec = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        rec["steps_per_s_runs"] = [r["steps_per_s"] for r in runs]
    return rec


def verdict(rec: dict[str, Any]) -> tuple[str, str, str]:
    """(steps target, cpu target, PASS/MISS) for one record."""
    r = rec["running"]
    ok = True
    steps_t = cpu_t = "-"
    if r in TARGET_STEPS_PER_S:
        steps_t = f">= {TARGET_STEPS_PER_S[r]:,.0f}"
        ok &= rec["steps_per_s"] >= TARGET_STEPS_PER_S[r]
    if r in TARGET_CPU_US_PER_STEP:
        cpu_t = f"<= {TARGET_CPU_US_PER_STEP[r]:,.0f}"
        ok &= rec["daemon_cpu_us_per_step"] <= TARGET_CPU_US_PER_STEP[r]
    has_target = r in TARGET_STEPS_PER_S or r in TARGET_CPU_US_PER_STEP
    return steps_t, cpu_t, ("PASS" if ok else "MISS") if has_target else "-"


def print_table(records: list[dict[str, Any]]) -> None:
    head = (
        f"{'tracing':>7} {'running':>7} {'steps/s':>9} {'target':>8} {'daemon us/step':>14} "
        f"{'target':>8} {'tokens/s':>10} {'sched/s':>8} {'worker us':>9} {'front us':>8} {'tok/wstep':>9} {'other':>5}  result"
    )
    print(head)
    print("-" * len(head))
    for rec in records:
        steps_t, cpu_t, ok = verdict(rec)
        print(
            f"{rec['tracing']:>7} {rec['running']:>7} {rec['steps_per_s']:>9,.0f} {steps_t:>8} "
            f"{rec['daemon_cpu_us_per_step']:>14,.0f} {cpu_t:>8} {rec['tokens_per_s']:>10,} "
            f"{rec['daemon_schedules_per_s']:>8,.0f} {rec['worker_cpu_us_per_step']:>9,.0f} "
            f"{rec['frontend_cpu_us_per_step']:>8,.0f} {rec.get('worker_tokens_per_step', 0):>9,.0f} "
            f"{rec['other_load_cores']:>5.2f}  {ok}"
        )


def pair_ratios(runs: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[int, list[float]]:
    """Per R, otlp / none steps/s of each back-to-back pair of runs (run i of each mode)."""
    out = {}
    for (n, mode), otlp in runs.items():
        if mode == "otlp" and (n, "none") in runs:
            out[n] = [
                o["steps_per_s"] / b["steps_per_s"] if b["steps_per_s"] else 0.0
                for b, o in zip(runs[(n, "none")], otlp, strict=True)
            ]
    return out


def print_tracing_ratio(records: list[dict[str, Any]]) -> None:
    by = {(r["tracing"], r["running"]): r for r in records}
    rows = [
        (n, by[("none", n)], by[("otlp", n)]) for t, n in by if t == "otlp" and ("none", n) in by
    ]
    if not rows:
        return
    print()
    print(f"tracing cost: otlp / none steps/s (target >= {TARGET_TRACING_RATIO:.2f})")
    for n, none, otlp in rows:
        ratio = otlp["steps_per_s"] / none["steps_per_s"] if none["steps_per_s"] else 0.0
        cpu = otlp["daemon_cpu_us_per_step"] - none["daemon_cpu_us_per_step"]
        spans = otlp.get("otlp_spans_received", 0)
        pairs = otlp.get("pair_ratios", [ratio])
        verdict_ratio = statistics.median(pairs)
        ok = "PASS" if verdict_ratio >= TARGET_TRACING_RATIO else "MISS"
        print(
            f"  running {n:>5}: {otlp['steps_per_s']:,.0f} / {none['steps_per_s']:,.0f} = "
            f"{ratio:.3f} (medians)  ({cpu:+,.0f} daemon us/step; sink received {spans} spans)"
        )
        if len(pairs) > 1:
            print(
                f"    per back-to-back pair: {', '.join(f'{r:.3f}' for r in pairs)}; "
                f"median {verdict_ratio:.3f}  {ok}"
            )
        else:
            print(f"    {ok}")
        if not otlp["finished_in_window"]:
            print(
                "    no request ended (so none began) in the window: tracing had no span to "
                "make there, this ratio is run-to-run noise; --max-tokens 256 prices the spans"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", default="256,1024", help="running batch sizes, comma separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per case")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after all R run")
    ap.add_argument("--tracing", choices=("none", "otlp"), default="none")
    ap.add_argument("--sessions", type=int, default=1, help="Session streams in the front end")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="per request")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the median is kept")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the records")
    ap.add_argument(
        "--hot-path", action="store_true", help="only time the daemon's Python per step, no gRPC"
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.running.split(",") if x.strip()]
    if args.hot_path:
        print_hot_path(sizes, steps=300)
        return
    modes = ["none", "otlp"] if args.tracing == "otlp" else ["none"]
    print(
        f"kvsched transport: daemon + 1 zero-cost sim worker + {args.sessions} Session stream(s), "
        f"{args.seconds:g} s window per case, {args.repeat} run(s) each (median kept)"
    )
    print(
        f"machine: {machine()}; daemon, worker, front end"
        + (" and OTLP sink" if args.tracing == "otlp" else "")
        + " share these cores: figures are noisy and bound by the sum of their CPU per step"
    )
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(n, m): [] for n in sizes for m in modes}
    for _ in range(args.repeat):
        for n in sizes:
            for mode in modes:  # none and otlp back to back per R, so drift hits both alike
                rec = run_case(n, mode, args.seconds, args.warmup, args.sessions, args.max_tokens)
                print(
                    f"  running {n} tracing {mode}: {rec['steps_per_s']:,.0f} steps/s, "
                    f"{rec['daemon_cpu_us_per_step']:,.0f} daemon us/step, "
                    f"other load {rec['other_load_cores']:.2f} cores",
                    flush=True,
                )
                runs[(n, mode)].append(rec)
    records = [median_run(rs) for rs in runs.values()]
    for n, ratios in pair_ratios(runs).items():
        for rec in records:
            if rec["running"] == n and rec["tracing"] == "otlp":
                rec["pair_ratios"] = [round(r, 3) for r in ratios]
                rec["median_pair_ratio"] = round(statistics.median(ratios), 3)
    print()
    print_table(records)
    busy = max(r["other_load_cores"] for r in records)
    if busy > 0.25:
        print(f"WARNING: other processes kept up to {busy:.2f} cores busy during the windows")
    print_tracing_ratio(records)
    print(
        "\nsteps/s: tokens delivered / running / s. sched/s: the daemon's schedule() calls. "
        "worker us, front us: their CPU per step.\ntok/wstep: tokens per worker step over the "
        "worker's whole run (below `running`: its steps ran with slots paused for blocks).\n"
        "other: cores busy with processes outside this benchmark during the window (0 on a "
        "quiet machine)."
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
