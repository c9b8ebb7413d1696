"""Run the nemesis suite: start the cluster, load it, apply the seeded schedule, heal, settle,
check (see bench/chaos/__init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chaos.checker import check, table
from bench.chaos.history import History, load
from bench.chaos.load import Load
from bench.chaos.nemesis import Nemesis
from bench.chaos.observe import Observer
from bench.chaos.procs import ChaosCluster
from bench.chaos.schedule import KINDS, counts, make_schedule

RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass
class Options:
    seed: int = 1
    duration_s: float = 60.0
    ttl_s: float = 3.0
    rate_per_s: float = 2.0
    max_in_flight: int = 40
    kinds: tuple[str, ...] = KINDS
    speed: float = 0.3
    gap_ttl: tuple[float, float] = (2.0, 4.0)
    drain_s: float = 240.0
    run_dir: str = ""


async def _settle(deadline_s: float, poll_s: float, fn: Any, done: Any) -> tuple[Any, float]:
    """Call `fn` every poll_s until done(result) or deadline_s; the last result and the time."""
    t0 = time.monotonic()
    while True:
        try:
            r = await fn()
        except Exception:
            r = None
        if (r is not None and done(r)) or time.monotonic() - t0 > deadline_s:
            return r, time.monotonic() - t0
        await asyncio.sleep(poll_s)


async def _drive(o: Options, c: ChaosCluster, h: History) -> dict[str, Any]:
    faults = make_schedule(o.seed, o.duration_s, o.ttl_s, kinds=o.kinds, gap_ttl=o.gap_ttl)
    obs = Observer(c, h)
    await obs.start()
    _, waited = await _settle(120.0, 0.5, obs.observe, bool)
    if not obs.last_converged:
        raise RuntimeError(f"the cluster never came up converged in {waited:.0f} s")
    h.t0 = time.monotonic()  # the schedule's clock starts with the load
    h.add(
        "config",
        seed=o.seed,
        ttl_s=o.ttl_s,
        duration_s=o.duration_s,
        rate_per_s=o.rate_per_s,
        instances=c.instances,
        daemons=c.daemon_ids,
        home={iid: c.daemon_ids[c.home[w]] for w, iid in enumerate(c.instances)},
        schedule=[f.to_json() for f in faults],
        schedule_counts=counts(faults),
    )
    ld = Load(c.addresses, h, o.seed, o.rate_per_s, o.max_in_flight)
    nem = Nemesis(c, h)
    try:
        await asyncio.gather(ld.run(o.duration_s), nem.run(faults, o.duration_s))
        await asyncio.to_thread(nem.heal_all)
        h.add("final_heal")
        heal_t = h.now()
        cancelled = await ld.drain(o.drain_s)
        await asyncio.sleep(max(0.0, heal_t + 3 * o.ttl_s - h.now()))  # observed past 2 x TTL
        held_missing, _ = await _settle(
            30.0,
            0.5,
            obs.blocks_held,
            lambda r: not r[1] and not any(v for d in r[0].values() for v in d.values()),
        )
        held, missing = held_missing if held_missing else ({}, ["?"])
        await obs.sample_gen_tokens()  # the counters once every request ended
        base = [n for n in _consumer_samples(h) if n is not None]
        settled, settle_s = await _settle(
            30.0, 1.0, obs.consumers, lambda n: bool(base) and n <= max(base)
        )
    finally:
        await obs.close()
        await ld.close()
    return {
        "blocks_held": held,
        "status_missing": missing,
        "consumers": settled,
        "consumers_settle_s": round(settle_s, 1),
        "cancelled_at_drain": cancelled,
        "submitted": ld.submitted,
    }


def _consumer_samples(h: History) -> list[int]:
    """Consumer counts recorded before the first fault (the baseline), read back from disk."""
    h._f.flush()
    evs = load(h.path)
    first = min((e["t"] for e in evs if e["ev"] == "fault_start"), default=float("inf"))
    return [e["n"] for e in evs if e["ev"] == "consumers" and e["t"] < first]


def run(o: Options, json_out: Path | None = None) -> dict[str, Any]:
    run_dir = Path(o.run_dir or tempfile.mkdtemp(prefix=f"kvsched-chaos-{o.seed}-"))
    if (run_dir / "history.jsonl").exists():  # a rerun: start from a clean folder
        shutil.rmtree(run_dir)
    c = ChaosCluster(run_dir, o.ttl_s, worker_speed=o.speed)
    h = History(run_dir / "history.jsonl")
    final: dict[str, Any] = {}
    try:
        c.start()
        final = asyncio.run(_drive(o, c, h))
    finally:
        final["worker_tokens"] = c.stop()
        h.add("final", **final)
        h.close()
    report = check(load(h.path))
    report["history"] = str(h.path)
    report["run_dir"] = str(run_dir)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description="bench.chaos: a Jepsen-style nemesis suite")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load and faults")
    ap.add_argument("--ttl-s", type=float, default=3.0, help="the daemons' member_ttl_s")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second submitted")
    ap.add_argument("--max-in-flight", type=int, default=40)
    ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds (schedule.py)")
    ap.add_argument("--speed", type=float, default=0.3, help="sim workers' --speed")
    ap.add_argument("--gap-ttl", default="2,4", help="quiet gap between faults, x TTL")
    ap.add_argument("--drain-s", type=float, default=240.0)
    ap.add_argument("--run-dir", default="", help="logs and history (default: a temp folder)")
    ap.add_argument("--json", default="", help="default bench/results/chaos_seedN_Ds.json")
    a = ap.parse_args()
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown fault kinds {bad}; known: {', '.join(KINDS)}")
    g0, g1 = (float(x) for x in a.gap_ttl.split(","))
    o = Options(
        seed=a.seed,
        duration_s=a.duration,
        ttl_s=a.ttl_s,
        rate_per_s=a.rate,
        max_in_flight=a.max_in_flight,
        kinds=kinds,
        speed=a.speed,
        gap_ttl=(g0, g1),
        drain_s=a.drain_s,
        run_dir=a.run_dir,
    )
    out = Path(a.json) if a.json else RESULTS / f"chaos_seed{a.seed}_{a.duration:g}s.json"
    report = run(o, out)
    print(table(report))
    print(f"history {report['history']}; wrote {out}")
