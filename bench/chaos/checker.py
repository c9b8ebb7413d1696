"""The checker: properties of a recorded history (history.py), each PASS or FAIL with counts.

    python -m bench.chaos.checker HISTORY.jsonl [--json OUT]

- `exactly_once_exact_tokens`: every accepted request ended exactly once (one `finish`, none
  `lost`), its tokens exactly the sim oracle's (SimExecutor(seed 0).token_at, the worker's own
  function), `output_tokens == max_tokens`.
- `refused_only_in_faults`: every refused call (generate or resume; a resume's NOT_FOUND is
  the protocol, not a refusal) came while a fault lasted or within 2 s after it ended.
- `converged_after_heal`: within 2 x TTL of the final heal, every instance is leased (NATS KV)
  to exactly the one daemon its worker is attached to (each daemon's admin status), and stays
  so to the end. Convergence after each fault, before the next one starts, is reported too.
- `no_kv_block_held`: at the end, every instance of every daemon has all blocks free and no
  request running or waiting.
- `consumers_bounded`: JetStream consumers on the server (/jsz) after the final settle are no
  more than before the first fault (every reconnect's consumers gone again).
- `duplicate_gpu_work` (reported): output tokens the daemons accepted from workers
  (kvsched_generation_tokens, summed over each daemon life's last scrape) over the tokens the
  clients needed; the workers' own counts (lives ended cleanly) beside it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.chaos.history import load
from kvsched.worker_stub.sim import SimExecutor

REFUSAL_GRACE_S = 2.0


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    ys = sorted(xs)
    return round(ys[min(len(ys) - 1, round(p * (len(ys) - 1)))], 3)


def _converged(obs: dict[str, Any], instances: list[str]) -> bool:
    if obs.get("unknown") or not obs.get("nats"):
        return False
    for iid in instances:
        at = obs["attached"].get(iid, [])
        if len(at) != 1 or obs["leases"].get(iid) != at[0]:
            return False
    return True


def check(events: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = next(e for e in events if e["ev"] == "config")
    ttl = float(cfg["ttl_s"])
    instances: list[str] = cfg["instances"]
    sim = SimExecutor(seed=0)
    by = defaultdict(list)
    for e in events:
        by[e["ev"]].append(e)

    # 1. exactly once, exact tokens
    subs = {e["rid"]: e for e in by["submit"]}
    toks: dict[str, list[int]] = defaultdict(list)
    for e in by["tokens"]:
        toks[e["rid"]].extend(e["toks"])
    accepted = {e["rid"] for e in by["accepted"]}
    finishes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in by["finish"]:
        finishes[e["rid"]].append(e)
    lost = {e["rid"] for e in by["lost"]}
    wrong, twice, unfinished, short = [], [], [], []
    for rid in sorted(accepted):
        s = subs[rid]
        want = [sim.token_at(rid, s["prompt_len"] + i) for i in range(s["max_tokens"])]
        got = toks[rid]
        f = finishes.get(rid, [])
        if len(f) > 1:
            twice.append(rid)
        if not f:
            unfinished.append(rid)
        elif f[0]["output_tokens"] != s["max_tokens"] or f[0]["reason"] != "length":
            short.append(rid)  # ended, but not with all its tokens (an error, an abort)
        # Wrong: a token the oracle does not give at that position, one too many, or a
        # request that finished "length" short of its tokens.
        if got != want[: len(got)] or (f and f[0]["reason"] == "length" and got != want):
            wrong.append(rid)
    never = sorted(set(subs) - accepted)
    p1 = {
        "result": "PASS" if not (wrong or twice or unfinished or short) else "FAIL",
        "submitted": len(subs),
        "accepted": len(accepted),
        "finished_exact": len(accepted)
        - len(set(wrong) | set(twice) | set(unfinished) | set(short)),
        "lost": len(unfinished),
        "client_gave_up": len(lost),
        "wrong_tokens": len(wrong),
        "finished_twice": len(twice),
        "ended_with_error": len(short),
        "never_accepted": len(never),
        "examples": sorted(set(wrong + twice + unfinished + short))[:5],
        "error_messages": sorted(
            {finishes[r][0].get("message", "") for r in short if finishes.get(r)}
        )[:5],
    }

    # 2. refusals only while a fault lasts (+2 s)
    ends = {e["id"]: e["t"] for e in by["fault_end"]}
    windows = [
        (e["t"], ends.get(e["id"], float("inf")) + REFUSAL_GRACE_S) for e in by["fault_start"]
    ]
    refused = [e for e in by["refused"]]
    outside = [e for e in refused if not any(a <= e["t"] <= b for a, b in windows)]
    late = []  # for each refusal outside: seconds since the last fault before it ended
    for e in outside:
        ended = [b - REFUSAL_GRACE_S for a, b in windows if b - REFUSAL_GRACE_S <= e["t"]]
        late.append(e["t"] - max(ended) if ended else e["t"])
    msgs: dict[str, int] = defaultdict(int)
    for e in outside:
        msgs[e["msg"][:90]] += 1
    codes: dict[str, int] = defaultdict(int)
    for e in refused:
        codes[e["code"]] += 1
    p2 = {
        "result": "PASS" if not outside else "FAIL",
        "refused_calls": len(refused),
        "outside_faults": len(outside),
        "by_code": dict(codes),
        "outside_s_after_fault_end": {"p50": _q(late, 0.5), "max": _q(late, 1.0)},
        "outside_messages": dict(msgs),
        "examples": [
            {k: e[k] for k in ("t", "rid", "daemon", "call", "code", "msg")} for e in outside[:5]
        ],
    }

    # 3. convergence of ownership
    obs = by["obs"]
    heal = by["final_heal"][0]["t"] if by["final_heal"] else None
    conv_s = None
    stays = False
    if heal is not None:
        after = [o for o in obs if o["t"] >= heal]
        first = next((o for o in after if _converged(o, instances)), None)
        if first is not None:
            conv_s = round(first["t"] - heal, 3)
            stays = all(_converged(o, instances) for o in after if o["t"] >= first["t"])
        last = after[-1] if after else None
    per_fault: list[float] = []
    not_conv = 0
    starts = sorted(e["t"] for e in by["fault_start"]) + [heal if heal is not None else 1e18]
    for e in by["fault_end"]:
        nxt = min(t for t in starts if t > e["t"])
        c = next((o for o in obs if e["t"] <= o["t"] < nxt and _converged(o, instances)), None)
        if c is None:
            not_conv += 1
        else:
            per_fault.append(c["t"] - e["t"])
    p3 = {
        "result": "PASS" if conv_s is not None and conv_s <= 2 * ttl and stays else "FAIL",
        "bound_s": 2 * ttl,
        "final_heal_to_converged_s": conv_s,
        "stays_converged": stays,
        "last_observation": None if heal is None or last is None else _brief(last),
        "after_each_fault_s": {
            "p50": _q(per_fault, 0.5),
            "p99": _q(per_fault, 0.99),
            "max": _q(per_fault, 1.0),
            "converged": len(per_fault),
            "not_before_next_fault": not_conv,
        },
    }

    # 4. KV blocks
    final = by["final"][0] if by["final"] else {}
    held = final.get("blocks_held", {})
    n_held = sum(v for d in held.values() for v in d.values())
    p4 = {
        "result": "PASS" if final and n_held == 0 and not final.get("status_missing") else "FAIL",
        "blocks_held": n_held,
        "held_by": {
            d: {i: v for i, v in x.items() if v} for d, x in held.items() if any(x.values())
        },
        "status_missing": final.get("status_missing", []),
    }

    # 5. JetStream consumers
    first_fault = min((e["t"] for e in by["fault_start"]), default=float("inf"))
    base = [e["n"] for e in by["consumers"] if e["t"] < first_fault]
    allc = [e["n"] for e in by["consumers"]]
    settled = final.get("consumers")
    baseline = max(base) if base else None
    p5 = {
        "result": "PASS"
        if settled is not None and baseline is not None and settled <= baseline
        else "FAIL",
        "before_faults": baseline,
        "max_during_run": max(allc) if allc else None,
        "after_settle": settled,
        "samples": len(allc),
    }

    # 6. duplicate GPU work
    lives: dict[tuple[str, int], int] = {}
    for e in by["gen_tokens"]:
        k = (e["daemon"], e["life"])
        lives[k] = max(lives.get(k, 0), int(e["v"]))
    computed = sum(lives.values())
    needed = sum(subs[r]["max_tokens"] for r in accepted)
    wt = final.get("worker_tokens", {})
    p6 = {
        "result": "INFO",
        "tokens_needed": needed,
        "tokens_accepted_by_daemons": computed,
        "ratio": round(computed / needed, 4) if needed else None,
        "worker_tokens_clean_lives": sum(v["tokens"] for v in wt.values()),
        "worker_lives_without_stats": sum(v["lives"] - v["stats"] for v in wt.values()),
    }
    faults: dict[str, int] = defaultdict(int)
    for e in by["fault_start"]:
        faults[e["kind"] + ("_long" if e["long"] else "")] += 1
    return {
        "seed": cfg["seed"],
        "duration_s": cfg["duration_s"],
        "ttl_s": ttl,
        "wall_s": round(events[-1]["t"], 1),
        "faults_started": len(by["fault_start"]),
        "faults_by_kind": dict(sorted(faults.items())),
        "properties": {
            "exactly_once_exact_tokens": p1,
            "refused_only_in_faults": p2,
            "converged_after_heal": p3,
            "no_kv_block_held": p4,
            "consumers_bounded": p5,
            "duplicate_gpu_work": p6,
        },
    }


def _brief(o: dict[str, Any]) -> dict[str, Any]:
    return {k: o.get(k) for k in ("t", "leases", "attached", "unknown", "nats")}


def table(report: dict[str, Any]) -> str:
    lines = [
        f"seed {report['seed']}, {report['duration_s']} s of faults, TTL {report['ttl_s']} s, "
        f"{report['faults_started']} faults: "
        + ", ".join(f"{k} {v}" for k, v in report["faults_by_kind"].items()),
        f"{'property':<28} {'result':<6} counts",
    ]
    for name, p in report["properties"].items():
        counts = ", ".join(
            f"{k} {v}" for k, v in p.items() if k not in ("result", "examples", "last_observation")
        )
        lines.append(f"{name:<28} {p['result']:<6} {counts}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="check a bench.chaos history")
    ap.add_argument("history", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = check(load(args.history))
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
