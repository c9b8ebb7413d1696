"""Failover: a daemon with its journal killed with SIGKILL under load and restarted with the
same id; how long until its clients get tokens again, and what the worker's reconnect backoff
costs.

    python -m bench.failover [--streams 100] [--max-tokens 300] [--reconnect-max 1,5]
                             [--down-s 0,3] [--json bench/results/failover.json]

For each `--reconnect-max` value S: a nats-server with JetStream, `kvsched serve --cluster ...
--daemon-id bench` on a fixed port, two sim workers (`--speed 0.3`, `--reconnect-max-s S`),
and `--streams` Generate streams followed by kvsched.client.resumable. Once every stream holds 5
tokens, the daemon is killed with SIGKILL and started again after `--down-s` seconds (0: at
once; 3: a longer outage, where the backoff's ceiling shows). Reported: restart_s (kill to
`listening`: the new process's start and journal recovery), reattach_s (`listening` to both
workers attached again: their reconnect backoff), kill_to_first_token p50/p99 (per stream cut
by the kill: from the break its client saw to its first token after the restart), and the
checks: every stream finished once with exactly the sim's tokens, no KV block held at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvsched.client import AsyncClient, Client
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.natsd import NatsServer, free_port
from kvsched.replay.launch import Child, spawn, start_daemon
from kvsched.worker_stub.sim import SimExecutor

SIM = SimExecutor(seed=0)
DEFAULT_JSON = Path(__file__).parent / "results" / "failover.json"


def ready_count(address: str) -> int:
    try:
        with Client(address, timeout=2) as c:
            return sum(i.ready for i in c.status().instances)
    except Exception:
        return 0


def wait_ready(address: str, n: int, timeout_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while ready_count(address) < n:
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"workers not back within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def q(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, round(p * (len(ys) - 1)))]


async def load(address: str, streams: int, max_tokens: int, kill: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, 30000, size=int(rng.integers(16, 200))).tolist() for _ in range(streams)
    ]
    async with AsyncClient(address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
        ss = [
            resumable(client, p, request_id=f"f{i}", max_tokens=max_tokens, retry_for_s=120)
            for i, p in enumerate(prompts)
        ]
        tasks = [asyncio.create_task(s.read_all()) for s in ss]
        while any(len(s.tokens) < 5 for s in ss):
            await asyncio.sleep(0.02)
        cut = sum(len(s.tokens) < max_tokens for s in ss)
        timing = await asyncio.to_thread(kill)
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    wrong = sum(
        s.tokens != [SIM.token_at(f"f{i}", len(prompts[i]) + k) for k in range(max_tokens)]
        for i, s in enumerate(ss)
    )
    gaps = [t for s in ss for t in s.first_token_after_break]
    return {
        "streams": streams,
        "cut_by_the_kill": cut,
        "resumed": sum(s.resumes > 0 for s in ss),
        "finished": sum(s.finished is not None for s in ss),
        "wrong_tokens": wrong,
        "kill_to_first_token_s": {
            "p50": round(statistics.median(gaps), 3) if gaps else None,
            "p99": round(q(gaps, 0.99), 3) if gaps else None,
        },
        **timing,
    }


def run(reconnect_max: float, down_s: float, streams: int, max_tokens: int) -> dict[str, Any]:
    with NatsServer() as nats:
        port = free_port()
        args = ("--listen", f"127.0.0.1:{port}", "--cluster", nats.url, "--daemon-id", "bench")
        state: dict[str, Child] = {}
        state["d"], address = start_daemon(*args)
        wargs = ("--executor", "sim", "--speed", "0.3", "--reconnect-max-s", str(reconnect_max))
        workers = [
            spawn(f"w{i}", "worker", "--server", address, "--instance", f"i{i}", *wargs)
            for i in range(2)
        ]
        try:
            wait_ready(address, 2)

            def kill() -> dict[str, float]:
                t0 = time.monotonic()
                state["d"].popen.kill()
                state["d"].popen.wait()
                time.sleep(down_s)
                state["d"], _ = start_daemon(*args)
                restart = time.monotonic() - t0
                reattach = wait_ready(address, 2)
                return {"restart_s": round(restart, 3), "reattach_s": round(reattach, 3)}

            rec = asyncio.run(load(address, streams, max_tokens, kill))
            with Client(address, timeout=5) as c:
                st = c.status()
            rec["blocks_held_at_end"] = sum(
                i.num_gpu_blocks - i.num_free_blocks for i in st.instances
            )
            rec["reconnect_max_s"] = reconnect_max
            rec["down_s"] = down_s
            return rec
        finally:
            for w in workers:
                w.stop()
            state["d"].stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--reconnect-max", default="1,5", help="worker --reconnect-max-s values")
    ap.add_argument("--down-s", default="0,3", help="seconds the daemon stays down")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    recs = []
    for down in (float(x) for x in args.down_s.split(",")):
        for s in (float(x) for x in args.reconnect_max.split(",")):
            rec = run(s, down, args.streams, args.max_tokens)
            recs.append(rec)
            print(json.dumps(rec), flush=True)
    print()
    print(
        f"{'down s':>6} {'reconnect max s':>15} {'restart s':>9} {'reattach s':>10} {'first tok p50':>13} "
        f"{'p99':>6} {'cut':>4} {'resumed':>7} {'wrong':>5} {'blocks held':>11}"
    )
    for r in recs:
        k = r["kill_to_first_token_s"]
        print(
            f"{r['down_s']:>6g} {r['reconnect_max_s']:>15g} {r['restart_s']:>9.2f} {r['reattach_s']:>10.2f} "
            f"{k['p50']:>13.2f} {k['p99']:>6.2f} {r['cut_by_the_kill']:>4} {r['resumed']:>7} "
            f"{r['wrong_tokens']:>5} {r['blocks_held_at_end']:>11}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(recs, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
