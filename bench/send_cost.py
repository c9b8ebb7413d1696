"""Where a request's send goes: the replay's client to the daemon's arrival stamp (issue 37).

    python -m bench.send_cost [--trace PATH] [--window 0-60] [--instances 4] [--rounds 3]
                              [--streams 1] [--py-spy OUT.txt] [--json OUT]
    python -m bench.send_cost --stages [--trace PATH] [--window 0-300]

The replay (`kvsched replay --embedded`'s path: a real `kvsched serve`, N sim worker processes,
real time, the replay's Session client) of one window of the Mooncake conversation trace,
gpu-only, `--rounds` times. Per request, from the daemon's OTLP span (`bench.tier_compare`'s
SpanSink): **send** = the daemon's arrival stamp - the request's arrival time in the replay,
**client_late** = the client's write done - its arrival time. Both by the request's place among
those arriving at the same instant (the trace's bursts, every ~3 s): a cost paid per request,
one after another, grows with the place; the slope is the per-request cost. `--py-spy`: a
py-spy profile of the daemon over the first round (its folded stacks, summed by function).

`--stages`: the accept path's pieces in one process, no daemon, over the window's largest
burst: the client's build and serialization, the daemon's parse, the prompt to the core
request, the token-id check, the block hashes (median of 5 passes, per request and per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.policies import BLOCK_SIZE, DEFAULT_TRACE, NUM_GPU_BLOCKS
from bench.spans import traced_cluster
from bench.tier_compare import window_of
from kvsched.replay.runner import replay
from kvsched.traces import TraceRequest


def places(reqs: list[TraceRequest]) -> list[int]:
    """Each request's place (1, 2, ...) among the requests arriving at its instant."""
    out, pos, prev = [], 0, None
    for q in reqs:
        pos = pos + 1 if q.arrival_s == prev else 1
        prev = q.arrival_s
        out.append(pos)
    return out


def _ms(v: list[float]) -> dict[str, float]:
    v = sorted(v)
    if not v:
        return {}
    q = statistics.quantiles(v, n=10) if len(v) > 1 else [v[0]] * 9
    return {"p10": 1e3 * q[0], "p50": 1e3 * statistics.median(v), "p90": 1e3 * q[8], "n": len(v)}


def by_place(reqs: list[TraceRequest], values: list[float | None]) -> dict[str, float]:
    """Median (ms) by place in the burst, places from 12 on together."""
    by: dict[int, list[float]] = {}
    for p, v in zip(places(reqs), values, strict=True):
        if v is not None and not math.isnan(v):
            by.setdefault(min(p, 12), []).append(v)
    return {str(p): round(1e3 * statistics.median(v), 1) for p, v in sorted(by.items())}


def slope_ms(reqs: list[TraceRequest], values: list[float | None]) -> float:
    """Least-squares slope of the value (ms) on the place: the cost each request adds to the
    ones behind it in its burst."""
    pts = [
        (float(p), 1e3 * v)
        for p, v in zip(places(reqs), values, strict=True)
        if v is not None and not math.isnan(v)
    ]
    if len(pts) < 2:
        return float("nan")
    mx = statistics.fmean(p for p, _ in pts)
    my = statistics.fmean(v for _, v in pts)
    den = sum((p - mx) ** 2 for p, _ in pts)
    return sum((p - mx) * (v - my) for p, v in pts) / den if den else float("nan")


def one_round(
    reqs: list[TraceRequest], instances: int, spy: Path | None, streams: int = 1
) -> dict[str, Any]:
    """One replay of `reqs` (gpu-only, `instances` sim workers, `streams` Sessions): send and
    client_late per request (s; None where no span came), their summaries and the load."""
    sink, server, cluster = traced_cluster(
        instances, num_blocks=NUM_GPU_BLOCKS, block_size=BLOCK_SIZE
    )
    spy_proc = None
    if spy is not None and shutil.which("py-spy"):
        pid = str(cluster.daemons[0].popen.pid)
        spy_proc = subprocess.Popen(
            ["py-spy", "record", "-p", pid, "-r", "200", "-f", "raw", "-o", str(spy), "-n"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    load = {"before": os.getloadavg()}
    try:
        result = asyncio.run(replay(cluster.address, reqs, progress=False, streams=streams))
        sink.wait_for(len(reqs), 30.0)
    finally:
        if spy_proc is not None:
            spy_proc.send_signal(2)  # SIGINT: py-spy writes what it has
            try:
                spy_proc.wait(30)
            except subprocess.TimeoutExpired:
                spy_proc.kill()
                spy_proc.wait(5)
        cluster.stop()
        server.stop(None)
    load["after"] = os.getloadavg()
    t0 = result.t0_wall_ns
    send: list[float | None] = []
    late: list[float | None] = []
    for rec in result.records:
        ns = sink.spans.get(rec.req_id, {}).get("arrival_ns")
        send.append((ns - t0) / 1e9 - rec.arrival_s if ns else None)
        late.append(None if rec.sent_s is None else rec.sent_s - rec.arrival_s)
    return {
        "send": _ms([v for v in send if v is not None]),
        "send_by_place": by_place(reqs, send),
        "send_slope_ms": round(slope_ms(reqs, send), 2),
        "client_late": _ms([v for v in late if v is not None]),
        "client_late_by_place": by_place(reqs, late),
        "load": load,
        "send_s": send,
        "client_late_s": late,
        "t0_wall_ns": t0,
    }


def profile_summary(raw: Path, top: int = 40) -> list[tuple[str, float]]:
    """py-spy's folded stacks: the share of samples each function appears in (inclusive)."""
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        k = int(n)
        total += k
        for fn in set(stack.split(";")):
            incl[fn] += k
    return [(fn, round(100 * k / total, 1)) for fn, k in incl.most_common(top)] if total else []


def stages(reqs: list[TraceRequest]) -> dict[str, dict[str, float]]:
    """Each piece of the accept path over the window's largest burst, ms a request (median of
    5 passes), twice: **list** as before the packed prompt (the message's ids to a list, the
    checks and the block hashes over the list's ints), **packed** as now (Request.prompt_array
    read by the checks and the hashes)."""
    from kvsched import codec
    from kvsched.client.types import build_submit
    from kvsched.core.block_hash import BlockHasher
    from kvsched.core.request import prompt_max_id
    from kvsched.core.scheduler.validation import prompt_ids_in_range
    from kvsched.v1 import request_service_pb2 as rpb

    at = Counter(q.arrival_s for q in reqs).most_common(1)[0][0]
    burst = [q for q in reqs if q.arrival_s == at]
    toks = sum(len(q.prompt_token_ids) for q in burst)
    print(f"burst at {at:g} s: {len(burst)} requests, {toks} prompt tokens")
    built = [
        build_submit(q.prompt_token_ids, {"request_id": f"t{i}", "max_tokens": 8}, f"t{i}")
        for i, q in enumerate(burst)
    ]
    ser = [m.SerializeToString() for m in built]
    parsed = [rpb.SessionRequest.FromString(b) for b in ser]
    hasher = BlockHasher(BLOCK_SIZE)
    core: dict[str, list[Any]] = {"list": [], "packed": []}

    bare = []  # the messages without their prompts: the old path's other fields
    for m in parsed:
        b = rpb.GenerateRequest()
        b.CopyFrom(m.submit.request)
        b.ClearField("prompt_token_ids")
        bare.append(b)

    def to_core(kind: str) -> None:
        out = []
        for i, m in enumerate(parsed):
            if kind == "list":  # as before: the list straight from the message, nothing packed
                r = codec.request_from_proto(bare[i], f"t{i}", 0.0)
                r.prompt_token_ids = m.submit.request.prompt_token_ids[:]
                r.prompt_array = None
            else:
                r = codec.request_from_proto(m.submit.request, f"t{i}", 0.0)
            out.append(r)
        core[kind] = out

    def check(kind: str) -> None:
        for r in core[kind]:
            prompt_ids_in_range(r)

    def vocab(kind: str) -> None:
        for r in core[kind]:
            prompt_max_id(r)

    def hashes(kind: str) -> None:
        for r in core[kind]:
            r.block_hashes = []
            hasher.ensure_hashes(r, len(r.prompt_token_ids) // BLOCK_SIZE)

    def timed(fn: Any, *a: Any) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn(*a)
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times) / len(burst)

    out: dict[str, dict[str, float]] = {}
    out["client: build_submit (ahead of the send)"] = {
        "list": timed(
            lambda: [build_submit(q.prompt_token_ids, {"max_tokens": 8}, "t") for q in burst]
        )
    }
    out["client: serialize"] = {"list": timed(lambda: [m.SerializeToString() for m in built])}
    out["daemon: parse"] = {"list": timed(lambda: [rpb.SessionRequest.FromString(b) for b in ser])}
    for name, fn in (
        ("daemon: request_from_proto", to_core),
        ("daemon: token-id range check", check),
        ("daemon: vocabulary check (largest id)", vocab),
        (f"daemon: block hashes ({BLOCK_SIZE}-token blocks)", hashes),
    ):
        out[name] = {kind: timed(fn, kind) for kind in ("list", "packed")}
    total = {
        k: sum(v.get(k, v["list"]) for n, v in out.items() if "ahead" not in n)
        for k in ("list", "packed")
    }
    out["sum (without the build)"] = total
    print(f"  {'ms a request':48s} {'list':>7s} {'packed':>7s}")
    for name, v in out.items():
        print(f"  {name:48s} {v['list']:7.3f} {v.get('packed', v['list']):7.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--window", default="0-60")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1, help="Session streams the replay uses")
    ap.add_argument("--stages", action="store_true", help="the pieces in one process, no daemon")
    ap.add_argument("--py-spy", type=Path, help="profile the daemon in round 1 (folded stacks)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reqs = window_of(args.trace, args.window)
    if args.stages:
        out: dict[str, Any] = {"stages_ms": stages(reqs), "load": os.getloadavg()}
    else:
        rounds = []
        for i in range(args.rounds):
            r = one_round(reqs, args.instances, args.py_spy if i == 0 else None, args.streams)
            rounds.append(r)
            print(
                f"round {i + 1}: send p50 {r['send'].get('p50', math.nan):.1f} ms "
                f"(p10 {r['send'].get('p10', math.nan):.1f}, p90 {r['send'].get('p90', math.nan):.1f})"
                f", slope {r['send_slope_ms']} ms a place; client_late p50 "
                f"{r['client_late'].get('p50', math.nan):.1f} ms; load {r['load']}"
            )
            print(f"  send by place: {r['send_by_place']}")
            print(f"  client_late by place: {r['client_late_by_place']}")
        out = {"window": args.window, "requests": len(reqs), "rounds": rounds}
        if args.py_spy is not None and args.py_spy.exists():
            out["profile"] = profile_summary(args.py_spy)
            for fn, pct in out["profile"]:
                print(f"  {pct:5.1f} %  {fn}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
