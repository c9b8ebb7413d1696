"""The KV tiers through `kvsched replay --embedded`, several rounds, and where the replay's TTFT
goes beside the simulator's, request by request (issue 37).

    python -m bench.tier_rounds [--trace PATH] [--window 0-300] [--configs gpu-only,host-4x,storage]
                                [--rounds 2] [--sim-latency-ms 2,5] [--sim-jitter-seeds 3]
                                [--json OUT] [--report]

The sim runs once per configuration (virtual time: identical every run), plus once per extra
control latency (`bench.simulate`'s `control_latency_s`: each Tasks message reaches its worker
that long after schedule()). The replays (`bench.tier_compare.run_replay`: a real daemon, 4 sim
worker processes, real time) run in rounds, every configuration once per round, so that the
box's load changes fall on all of them alike; each round's gain is against the same round's
gpu-only. Per configuration: the median and range over rounds of prefix hits (and their share
of the hit bound: the GPU + host LRU bound for host-4x, the unbounded cache for storage), TTFT
p50 and its gain, goodput, the prefetched share, and the 1-minute load average around each run.

Where the replay's TTFT goes (each replay beside the sim of the same configuration, per
request, means and medians; the means add up):
    client     client TTFT - the daemon's (arrival to first token in its span): the gRPC send,
               the daemon's accept, the token's way back to the client; split into
      client_late  the submit's write done on the client - the request's arrival time (part
               of send)
      send     the daemon's arrival (span start) - the request's arrival time in the replay
      deliver  the client's first token - the daemon's (span event first_token)
    queue      daemon queue time (arrival to placement) - the sim's
    service    daemon placement to first token - the sim's (steps, pacing, the Tasks' and the
               reports' trips)
The same split by where each run found a tier hit (`bench.tier_stats.by_tier_hit`: both, sim
only, replay only, neither), and beside every TTFT p50 its interquartile mean (`iqm`): the sim's
TTFTs sit on a ~100 ms lattice (budgeted steps, bursts of arrivals) and a p50 between two
lattice points jumps by a step when a few requests move. `--sim-jitter-seeds N`: the sim again
with every arrival moved by up to +-1 ms (seeded), N times: the sim's own spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.policies import BLOCK_SIZE, DEFAULT_TRACE, HOST_FACTOR, NUM_GPU_BLOCKS
from bench.tier_compare import (
    CONFIGS,
    _round,
    aggregate,
    differences,
    jittered,
    run_replay,
    run_sim,
    window_of,
)
from bench.tier_stats import by_tier_hit, gain, iqm
from kvsched.traces import TraceRequest, ideal_lru_hit_rate

DEFAULT_JSON = Path(__file__).parent / "results" / "tier_rounds.json"


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def gap(sim: list[dict[str, Any]], rep: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request, what the replay's TTFT has that the sim's (same configuration) has not."""
    keys = ("total", "client", "client_late", "send", "deliver", "queue", "service")
    parts: dict[str, list[float]] = {k: [] for k in keys}
    for s, r in zip(sim, rep, strict=True):
        vals = (s["ttft_s"], s["queue_s"], r["ttft_s"], r["queue_s"], r.get("daemon_ttft_s"))
        if any(v is None for v in vals):
            continue
        s_ttft, s_q, r_ttft, r_q, r_dttft = vals
        parts["total"].append(r_ttft - s_ttft)
        parts["client"].append(r_ttft - r_dttft)
        for k in ("client_late", "send", "deliver"):
            if r.get(f"{k}_s") is not None and not math.isnan(r[f"{k}_s"]):
                parts[k].append(r[f"{k}_s"])
        parts["queue"].append(r_q - s_q)
        parts["service"].append((r_dttft - r_q) - (s_ttft - s_q))
    out: dict[str, Any] = {"requests": len(parts["total"])}
    for k, xs in parts.items():
        out[k] = {"mean": _mean(xs), "p50": _med(xs)}
    return out


def sim_at_daemon_arrivals(
    reqs: list[TraceRequest], rrows: list[dict[str, Any]], name: str, args: Any, prompt: list[int]
) -> dict[str, Any]:
    """The sim with each request arriving when the replay's daemon got it (its send delay
    added), TTFT still counted from the trace's arrival: if this meets the replay, the send
    delay is the replay's extra TTFT."""
    sends = [
        r["send_s"] if r.get("send_s") is not None and not math.isnan(r["send_s"]) else 0.0
        for r in rrows
    ]
    moved = [
        dataclasses.replace(q, arrival_s=q.arrival_s + max(0.0, d))
        for q, d in zip(reqs, sends, strict=True)
    ]
    order = sorted(range(len(moved)), key=lambda i: moved[i].arrival_s)
    rows, summary = run_sim([moved[i] for i in order], name, args.instances)
    back: list[dict[str, Any]] = [{}] * len(rows)
    for k, i in enumerate(order):
        row = dict(rows[k])
        d = max(0.0, sends[i])
        if row["ttft_s"] is not None:
            row["ttft_s"] += d
        if row["queue_s"] is not None:
            row["queue_s"] += d
        back[i] = row
    return {"agg": aggregate(back, prompt), "goodput": summary["goodput_rps"]}


def sim_jitter(
    reqs: list[TraceRequest], name: str, instances: int, seeds: int
) -> dict[str, list[float | None]]:
    """The sim once per seed with every arrival moved by up to +-1 ms (uniform): TTFT p50,
    its interquartile mean and goodput per seed (seed k of every configuration moves the
    arrivals alike, so gains are taken seed by seed)."""
    out: dict[str, list[float | None]] = {"ttft_p50": [], "ttft_iqm": [], "goodput": []}
    for seed in range(seeds):
        rows, summary = run_sim(jittered(reqs, seed), name, instances)
        ttft = [r["ttft_s"] for r in rows]
        out["ttft_p50"].append(summary["ttft_s"]["p50"])
        out["ttft_iqm"].append(iqm(ttft))
        out["goodput"].append(summary["goodput_rps"])
    return out


def _rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """A saved run's columns back into one dict per request."""
    return [dict(zip(cols, v, strict=True)) for v in zip(*cols.values(), strict=True)]


def send_by_position(reqs: list[TraceRequest], rrows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median send delay (ms) by a request's place among those arriving at the same instant
    (the Mooncake traces' arrivals come every 3 s, up to 20 at once): a cost paid per request,
    one after another, grows with the place."""
    by: dict[int, list[float]] = {}
    pos, prev = 0, None
    for q, r in zip(reqs, rrows, strict=True):
        pos = pos + 1 if q.arrival_s == prev else 1
        prev = q.arrival_s
        d = r.get("send_s")
        if d is not None and not math.isnan(d):
            by.setdefault(min(pos, 12), []).append(d)
    return {str(p): 1e3 * statistics.median(v) for p, v in sorted(by.items())}


def spread(xs: list[float | None]) -> dict[str, Any]:
    v = [x for x in xs if x is not None]
    return {"median": _med(v), "min": min(v), "max": max(v), "all": v} if v else {}


def bounds(reqs: list[TraceRequest], instances: int) -> dict[str, float]:
    gpu_host = (1 + HOST_FACTOR) * NUM_GPU_BLOCKS * instances
    return {
        "unbounded": ideal_lru_hit_rate(reqs, None, BLOCK_SIZE),
        "gpu_host": ideal_lru_hit_rate(reqs, gpu_host, BLOCK_SIZE),
    }


def summarize_config(
    name: str, c: dict[str, Any], base: dict[str, Any] | None, b: dict[str, float]
) -> dict[str, Any]:
    """Median and range over rounds; gains against the same round's gpu-only."""
    bound = b["gpu_host"] if CONFIGS[name][0] and not CONFIGS[name][1] else b["unbounded"]
    reps = c["replays"]
    gains: list[float | None] = []
    gains_iqm: list[float | None] = []
    if base is not None:
        for r, g in zip(reps, base["replays"], strict=False):
            gains.append(gain(r["agg"]["ttft_p50"], g["agg"]["ttft_p50"]))
            gains_iqm.append(gain(r["agg"].get("ttft_iqm"), g["agg"].get("ttft_iqm")))
    sim_gain = sim_gain_iqm = None
    if base is not None:
        sim_gain = gain(c["sim"]["agg"]["ttft_p50"], base["sim"]["agg"]["ttft_p50"])
        sim_gain_iqm = gain(c["sim"]["agg"].get("ttft_iqm"), base["sim"]["agg"].get("ttft_iqm"))
    jit: dict[str, Any] = {}
    if base is not None and c.get("sim_jitter") and base.get("sim_jitter"):
        for k in ("ttft_p50", "ttft_iqm"):
            jit[k] = c["sim_jitter"][k]
            pairs = zip(c["sim_jitter"][k], base["sim_jitter"][k], strict=False)
            jit[f"gain_{k}"] = spread([gain(x, b) for x, b in pairs])
    return {
        "bound": bound,
        "sim": {
            "hit": c["sim"]["agg"]["hit"],
            "of_bound": c["sim"]["agg"]["hit"] / bound,
            "ttft_p50": c["sim"]["agg"]["ttft_p50"],
            "gain": sim_gain,
            "ttft_iqm": c["sim"]["agg"].get("ttft_iqm"),
            "gain_iqm": sim_gain_iqm,
            "goodput": c["sim"]["summary"]["goodput_rps"],
            "jitter": jit,
        },
        "replay": {
            "hit": spread([r["agg"]["hit"] for r in reps]),
            "of_bound": spread([r["agg"]["hit"] / bound for r in reps]),
            "ttft_p50": spread([r["agg"]["ttft_p50"] for r in reps]),
            "gain": spread(gains),
            "ttft_iqm": spread([r["agg"].get("ttft_iqm") for r in reps]),
            "gain_iqm": spread(gains_iqm),
            "goodput": spread([r["summary"]["goodput_rps"] for r in reps]),
            "prefetched": spread([r["summary"].get("storage_prefetched_frac", 0.0) for r in reps]),
            "gap_mean_s": spread([r["gap"]["total"]["mean"] for r in reps]),
            "load": [r["load_avg"] for r in reps],
        },
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.0f} %"


def report(out: dict[str, Any]) -> str:
    lines = [f"window {out['window']} s, {out['num_requests']} requests, bounds {out['bounds']}"]
    for name, s in out["summary"].items():
        sm, rp = s["sim"], s["replay"]
        lines.append(
            f"{name:9} sim: hit {100 * sm['hit']:.1f} % ({100 * sm['of_bound']:.0f} % of bound), "
            f"TTFT p50 {sm['ttft_p50']:.3f} ({_pct(sm['gain'])}), goodput {sm['goodput']:.2f}"
        )
        if sm.get("ttft_iqm") is not None:
            lines.append(f"{'':9} sim TTFT IQM {sm['ttft_iqm']:.3f} ({_pct(sm['gain_iqm'])})")

        def rng(d: dict[str, Any], f: str, scale: float = 1.0) -> str:
            return f"{d['median'] * scale:{f}} [{d['min'] * scale:{f}}-{d['max'] * scale:{f}}]"

        gain = rng(rp["gain"], "+.0f", 100) + " %" if rp["gain"] else "-"
        for k, label in (("ttft_p50", "p50"), ("ttft_iqm", "IQM")):
            if sm.get("jitter", {}).get(f"gain_{k}"):
                lines.append(
                    f"{'':9} sim, arrivals +-1 ms, TTFT {label} by seed: "
                    + " / ".join(f"{x:.3f}" for x in sm["jitter"][k])
                    + " ("
                    + " / ".join(_pct(x) for x in sm["jitter"][f"gain_{k}"]["all"])
                    + ")"
                )
        lines.append(
            f"{'':9} replay x{len(rp['load'])}: hit {rng(rp['hit'], '.1f', 100)} % "
            f"({rng(rp['of_bound'], '.0f', 100)} % of bound), TTFT p50 {rng(rp['ttft_p50'], '.3f')}"
            f" ({gain}), goodput {rng(rp['goodput'], '.2f')}, prefetched "
            f"{rng(rp['prefetched'], '.0f', 100)} %, load {rp['load']}"
        )
        if rp.get("ttft_iqm"):
            gi = rng(rp["gain_iqm"], "+.0f", 100) + " %" if rp.get("gain_iqm") else "-"
            lines.append(f"{'':9} replay TTFT IQM {rng(rp['ttft_iqm'], '.3f')} ({gi})")
        for i, r in enumerate(out["configs"][name]["replays"]):
            for grp, v in r.get("by_tier_hit", {}).items():
                if not v["requests"] or name == "gpu-only":
                    continue
                lines.append(
                    f"{'':9}   round {i + 1} tier hit in {grp}: {v['requests']} requests, replay -"
                    " sim mean (p50) s: "
                    + ", ".join(
                        f"{k} {v[k]['mean']:+.3f} ({v[k]['p50']:+.3f})"
                        for k in ("total", "send", "queue", "service")
                        if v[k]["mean"] is not None
                    )
                )
        for i, r in enumerate(out["configs"][name]["replays"]):
            g = r["gap"]
            lines.append(
                f"{'':9}   round {i + 1} replay - sim per request, mean (p50) s: "
                + ", ".join(
                    f"{k} {g[k]['mean']:+.3f} ({g[k]['p50']:+.3f})"
                    for k in (
                        "total",
                        "client",
                        "client_late",
                        "send",
                        "deliver",
                        "queue",
                        "service",
                    )
                    if g[k]["mean"] is not None
                )
            )
        for i, r in enumerate(out["configs"][name]["replays"]):
            if "send_ms_by_position" in r:
                by = ", ".join(f"{k}: {v:.0f}" for k, v in r["send_ms_by_position"].items())
                lines.append(f"{'':9}   round {i + 1} send p50 ms by place in its burst: {by}")
            if "sim_daemon_arrivals" in r:
                agg = r["sim_daemon_arrivals"]["agg"]
                lines.append(
                    f"{'':9}   sim at round {i + 1}'s daemon arrivals: hit {100 * agg['hit']:.1f} %,"
                    f" TTFT p50 {agg['ttft_p50']:.3f} (replay {r['agg']['ttft_p50']:.3f})"
                )
        for ms, agg in out["configs"][name].get("sim_latency", {}).items():
            lines.append(
                f"{'':9} sim, control latency {ms} ms: hit {100 * agg['hit']:.1f} %, TTFT p50 "
                f"{agg['ttft_p50']:.3f}, queue mean {agg['queue_mean']:.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--window", default="0-300", help="START-END in trace seconds")
    ap.add_argument("--configs", default="gpu-only,host-4x,storage", help=f"from {list(CONFIGS)}")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument(
        "--streams", type=int, default=1, help="the replay's Session streams (`replay --streams`)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sim-latency-ms", default="", help="extra sim runs, e.g. 2,5 (ms)")
    ap.add_argument(
        "--sim-jitter-seeds", type=int, default=0, help="sim runs with arrivals moved +-1 ms"
    )
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--report", action="store_true", help="print --json's results, run nothing")
    args = ap.parse_args(argv)
    if args.report:  # (also a run cut short: the rounds done so far)
        out = json.loads(args.json.read_text())
        reqs: list[TraceRequest] | None = None
        for c in out["configs"].values():  # what older results lack, from their rows
            srows = _rows(c["sim"]["rows"])
            c["sim"]["agg"].setdefault("ttft_iqm", iqm([x["ttft_s"] for x in srows]))
            for r in c["replays"]:
                rows = _rows(r["rows"])
                r["agg"].setdefault("ttft_iqm", iqm([x["ttft_s"] for x in rows]))
                r.setdefault("by_tier_hit", by_tier_hit(srows, rows))
                if "send_ms_by_position" not in r:  # needs the trace's arrival instants
                    reqs = reqs or window_of(out["trace"], out["window"])
                    r["send_ms_by_position"] = send_by_position(reqs, rows)
        base = out["configs"].get("gpu-only")
        out["summary"] = {
            n: summarize_config(n, c, base, out["bounds"])
            for n, c in out["configs"].items()
            if c["replays"]
        }
        print(report(out))
        return
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    reqs = window_of(args.trace, args.window)
    if not reqs:  # (the shipped slice holds the first 300 s only)
        ap.error(
            f"no request of {args.trace} arrives in window {args.window} s: pass the full "
            "trace with --trace, or set KVSCHED_TRACE_DIR to the folder that holds it"
        )
    prompt = [len(r.prompt_token_ids) for r in reqs]
    out: dict[str, Any] = {
        "trace": str(args.trace),
        "window": args.window,
        "num_requests": len(reqs),
        "instances": args.instances,
        "streams": args.streams,
        "bounds": bounds(reqs, args.instances),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "configs": {},
    }
    print(f"window {args.window} s: {len(reqs)} requests", flush=True)
    sims: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        rows, summary = run_sim(reqs, name, args.instances)
        sims[name] = rows
        cols = {k: [_round(x[k]) for x in rows] for k in (rows[0] if rows else {})}
        c = {"sim": {"agg": aggregate(rows, prompt), "summary": summary, "rows": cols}}
        c["replays"] = []
        lat = [float(x) for x in args.sim_latency_ms.split(",") if x]
        c["sim_latency"] = {
            str(ms): aggregate(
                run_sim(reqs, name, args.instances, control_latency_s=ms / 1e3)[0], prompt
            )
            for ms in lat
        }
        if args.sim_jitter_seeds:
            c["sim_jitter"] = sim_jitter(reqs, name, args.instances, args.sim_jitter_seeds)
        out["configs"][name] = c
    for rnd in range(args.rounds):
        for name in names:
            t0 = time.perf_counter()
            rrows, rsummary, load = run_replay(reqs, name, args.instances, args.streams)
            r = {"agg": aggregate(rrows, prompt), "summary": rsummary, "load_avg": load}
            r["wall_s"] = time.perf_counter() - t0
            r["diff"] = differences(sims[name], rrows)
            r["gap"] = gap(sims[name], rrows)
            r["by_tier_hit"] = by_tier_hit(sims[name], rrows)
            r["send_ms_by_position"] = send_by_position(reqs, rrows)
            r["rows"] = {k: [_round(x[k]) for x in rrows] for k in (rrows[0] if rrows else {})}
            if rnd == 0:  # the sim fed the daemon's measured arrivals (the send part)
                r["sim_daemon_arrivals"] = sim_at_daemon_arrivals(reqs, rrows, name, args, prompt)
            out["configs"][name]["replays"].append(r)
            print(f"  round {rnd + 1} {name}: {r['wall_s']:.0f} s, load {load}", flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)  # partial results kept
            args.json.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    base = out["configs"].get("gpu-only")
    out["summary"] = {
        n: summarize_config(n, c, base, out["bounds"]) for n, c in out["configs"].items()
    }
    print(report(out))
    args.json.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
