"""Issue 38: one daemon of three paused (SIGSTOP) or killed (kill -9) under streams of a client
written from the proto and docs/CLIENT.md alone (bench/plain_client.py: plain grpcio). The
scenario is tests/cluster/plain_kit.py (3 daemons on one nats-server, 6 sim workers listing
every daemon, streams round robin over the daemons); this adds the scale and the timing.

    PYTHONPATH=. python -m bench.plain_pause [--fault stop|kill] [--streams 150]
        [--tokens 600] [--pause-s 15] [--ttl-s 6] [--runs 3] [--json PATH]

Per run: streams exact (tokens and usage as an uninterrupted run), fault -> next token p50/p99
over every stream running at the fault, how many stalled (>= 1 s), how many got their next
token only after SIGCONT, convergence after SIGCONT (every instance at the one daemon its lease
names: no split), and the timeline of each stream past the target; a run past the target keeps
the daemons' logs in a temporary folder (its path: `logs` in the run's figures). Targets: stop, p99 <=
TTL + 1 s; kill, p99 <= 1.0 s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cluster import plain_kit
from tests.cluster.durability_kit import quantiles


def one(fault: str, streams: int, tokens: int, pause_s: float, ttl_s: float, seed: int) -> Any:
    load0 = os.getloadavg()[0]
    out = plain_kit.run(fault, streams, tokens, pause_s=pause_s, ttl_s=ttl_s, seed=seed)
    running = out.running_at_fault()
    stalls = {i: out.stall(i) for i in running}
    got = sorted(v for v in stalls.values() if v is not None)
    p50, p99 = quantiles(got) if got else (0.0, 0.0)
    target = ttl_s + 1.0 if fault == "stop" else 1.0
    wake = out.woke_at - out.fault_at
    fig = {
        "fault": fault,
        "streams": streams,
        "tokens": tokens,
        "ttl_s": ttl_s,
        "pause_s": pause_s if fault == "stop" else 0.0,
        "running_at_fault": len(running),
        "exact": streams - len(out.exact()),
        "errors": [repr(e) for e in out.errors[:5]],
        "no_token_after_fault": sum(1 for v in stalls.values() if v is None),
        "stalled_1s": sum(1 for v in got if v >= 1.0),
        "after_wake": sum(1 for v in got if fault == "stop" and v >= wake),
        "next_token_p50_s": round(p50, 3),
        "next_token_p99_s": round(p99, 3),
        "next_token_max_s": round(got[-1], 3) if got else 0.0,
        "target_s": target,
        "met": bool(got) and p99 <= target and not out.exact() and not out.errors,
        "converged_s": round(out.converged_s, 2),
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }
    if not fig["met"]:  # the daemons' whole logs, to find where the time went
        keep = Path(tempfile.mkdtemp(prefix=f"plain_pause_{fault}_{seed}_"))
        for did, text in out.outputs.items():
            (keep / f"{did}.log").write_text(text)
        fig["logs"] = str(keep)
    print(json.dumps(fig))
    print(out.events())
    worst = max(running, key=lambda i: stalls[i] or 1e9)
    print(f"worst stream, all of it: {out.timeline(worst)}")
    for i in running:
        v = stalls[i]
        if v is None or v > target:
            tl = out.timeline(i)
            print(f"  {v if v is None else round(v, 2)} s: {tl[:300]} ... {tl[-300:]}")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fault", choices=("stop", "kill"), default="stop")
    ap.add_argument("--streams", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--pause-s", type=float, default=15.0)
    ap.add_argument("--ttl-s", type=float, default=6.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    runs = []
    for r in range(a.runs):
        runs.append(one(a.fault, a.streams, a.tokens, a.pause_s, a.ttl_s, seed=5 + r))
    summary = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}
    print(
        f"{a.fault}: p99 {[r['next_token_p99_s'] for r in runs]} s (target {runs[0]['target_s']}"
        f" s), exact {[r['exact'] for r in runs]} of {a.streams}, met {[r['met'] for r in runs]}"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
