"""The journal's own CPU per request, without the daemon around it: `Journal.accept` (the
accepted record, acknowledged) then `Journal.finished` (finished record + tombstone, written by
the journal's writer) for `--requests` requests, one at a time and 8 at once, measured with
`time.thread_time` in a process of its own against one real nats-server.

    python -m bench.journal_micro [--requests 2000] [--rounds 3] [--old-src DIR]
                                  [--json bench/results/journal_micro.json]

With `--old-src` (another checkout's root, e.g. main's tree from `git archive main`), each
round runs that tree's journal and this one's alternately, in one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).parent / "results" / "journal_micro.json"


async def _child(url: str, n: int, conc: int, tag: str) -> dict[str, Any]:
    from kvsched.cluster.link import connect_cluster
    from kvsched.core import Request
    from kvsched.core.journal_state import JournalState
    from kvsched.durability.journal import Journal
    from kvsched.v1 import request_service_pb2 as rpb

    class Rec:
        def __init__(self, rid: str) -> None:
            self.req = Request(rid, list(range(3, 35)))
            self.owner, self.client_tag, self.finished = "alice", rid, False
            self.journal_state, self.journaled = JournalState.NONE, 0

    link = await connect_cluster(url, f"jm-{tag}-{conc}")
    journal = Journal(link)
    await journal.open()
    writer = asyncio.get_running_loop().create_task(journal.run(lambda: []))

    async def one(rid: str) -> None:
        r = Rec(rid)
        pb = rpb.GenerateRequest(request_id=rid, prompt_token_ids=r.req.prompt_token_ids)
        await journal.accept(r, pb, "i0")
        r.req.output_token_ids.extend(range(256))
        r.finished = True
        journal.finished(r)

    async def loop(k: int, rnd: int) -> None:
        for i in range(n // conc):
            await one(f"{tag}-{conc}-{rnd}-{k}-{i}")

    out: dict[str, Any] = {}
    for rnd in range(2):  # the first: warm-up
        await journal._outbox.join()
        t0, w0 = time.thread_time(), time.perf_counter()
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        await asyncio.gather(*(loop(k, rnd) for k in range(conc)))
        await journal._outbox.join()
        t1, w1 = time.thread_time(), time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        out = {
            "cpu_us_per_request": round(1e6 * (t1 - t0) / n, 1),
            "user_us": round(1e6 * (r1.ru_utime - r0.ru_utime) / n, 1),
            "sys_us": round(1e6 * (r1.ru_stime - r0.ru_stime) / n, 1),
            "wall_us_per_request": round(1e6 * (w1 - w0) / n, 1),
        }
    writer.cancel()
    await link.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old-src", default=None)
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--child", nargs=4, metavar=("URL", "N", "CONC", "TAG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        url, n, conc, tag = args.child
        print(json.dumps(asyncio.run(_child(url, int(n), int(conc), tag))))
        return
    from bench.transport_stack import machine
    from kvsched.cluster.natsd import NatsServer

    here = str(Path(__file__).resolve().parent.parent)
    trees = [("new", here)] + ([("old", args.old_src)] if args.old_src else [])
    print(f"journal CPU per request (accept + finish): {machine()}; load {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[float]] = {}
    records: list[dict[str, Any]] = []
    with NatsServer() as nats:
        for rnd in range(args.rounds):
            for conc in (1, 8):
                for tag, tree in trees if rnd % 2 == 0 else trees[::-1]:
                    proc = subprocess.run(
                        [
                            sys.executable,
                            str(Path(__file__).resolve()),  # kvsched from `tree`
                            "--child",
                            nats.url,
                            str(args.requests),
                            str(conc),
                            f"{tag}{rnd}",
                        ],
                        cwd=tree,
                        env={**os.environ, "PYTHONPATH": tree},
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    if proc.returncode != 0:
                        print(f"  {tag} x{conc}: FAILED {proc.stderr.strip()[-300:]}")
                        continue
                    rec = {
                        "src": tag,
                        "concurrency": conc,
                        "round": rnd + 1,
                        **json.loads(proc.stdout.strip().splitlines()[-1]),
                    }
                    records.append(rec)
                    runs.setdefault(f"{tag} x{conc}", []).append(rec["cpu_us_per_request"])
                    print(
                        f"  round {rnd + 1} {tag} x{conc}: {rec['cpu_us_per_request']:.0f} us CPU "
                        f"(user {rec['user_us']:.0f}, sys {rec['sys_us']:.0f})",
                        flush=True,
                    )
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print()
    for k, v in sorted(medians.items()):
        print(f"{k:>8}: median {v:.0f} us CPU per request over {len(runs[k])} rounds")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "load_average": os.getloadavg(),
                "runs": records,
                "median_cpu_us": medians,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
