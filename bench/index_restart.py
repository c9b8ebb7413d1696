"""A restarted daemon's cluster index: how long until it holds 99 % of what a warm one holds,
over a real nats-server (issue 25).

    .venv/bin/python -m bench.index_restart [--instances 32] [--gpu-blocks 512]
        [--host-blocks 2048] [--runs 3] [--json OUT]

A publishing daemon's `KvStream` serves `--instances` real schedulers (block size 16, a host
tier of `--host-blocks`, write_through) warmed with prompts until both tiers are full and have
evicted; a warm subscriber's index matches them. Then a fresh `KvStream` (the restarted
daemon: an empty index) starts, and the time from its start to its index holding 99 % (and
100 %) of the warm index's (instance, tier, hash) entries is measured. It catches up the way
any late joiner does: the first batch it hears of an instance (events, or its load alone every
`load_every_s` = 0.25 s) is an unknown epoch, so it asks the owner for a snapshot (GPU and host
hashes) and replays the batches received meanwhile. Wall-clock on a shared machine: noisy.
Writes bench/results/index_restart.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench.policies import write_json  # noqa: E402
from kvsched.cluster.kv_index import ClusterIndex  # noqa: E402
from kvsched.cluster.kv_stream import KvStream  # noqa: E402
from kvsched.cluster.link import connect_cluster  # noqa: E402
from kvsched.cluster.natsd import NatsServer  # noqa: E402
from kvsched.core import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from kvsched.core.config import WritePolicy  # noqa: E402
from kvsched.core.protocol import StepReport  # noqa: E402

DEFAULT_JSON = _REPO / "bench" / "results" / "index_restart.json"
BS = 16


def warm(args: argparse.Namespace, k: int) -> Scheduler:
    """A scheduler whose GPU and host tiers are full of prompts' blocks (served to the end)."""
    cfg = EngineConfig(
        cache=CacheConfig(
            block_size=BS,
            num_gpu_blocks=args.gpu_blocks,
            num_host_blocks=args.host_blocks,
            host_write_policy=WritePolicy.WRITE_THROUGH,
        ),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096),
    )
    s = Scheduler(cfg, instance_id=f"i{k}")
    s.enable_kv_events()
    rng = random.Random(k)
    n = (args.gpu_blocks + args.host_blocks) * BS // 1000 + 4
    for j in range(n):
        req = Request(f"w{k}-{j}", [rng.randrange(3, 30000) for _ in range(1000)])
        req.sampling = SamplingParams(max_tokens=1, ignore_eos=True)
        s.add_request(req)
        for _ in range(50):
            tasks = s.schedule()
            placed = {c.handle: c for c in tasks.chunks}
            rows = [(h, c.start + len(c.token_ids)) for h, c in placed.items()]
            s.apply_report(
                StepReport(
                    step=s.last_report_step + 1,
                    applied_seq=s.last_tasks_seq,
                    handles=[h for h, _ in rows],
                    num_computed=[e for _, e in rows],
                    num_new_tokens=[1] * len(rows),
                    token_ids=[7] * len(rows),
                    acked=tasks.preempts + tasks.aborts,
                )
            )
            if req.is_finished:
                break
    s.schedule()  # the last swap-outs' acknowledgement comes with the next report
    return s


def entries(index: ClusterIndex) -> set[tuple[str, str, int]]:
    out = set()
    for iid, v in index.instances.items():
        if v.synced:
            out |= {(iid, "gpu", h) for h in v.hashes}  # hash keys (hit_index.key64)
            out |= {(iid, "cpu", h) for h in v.host}
    return out


async def measure(args: argparse.Namespace, url: str, scheds: dict[str, Scheduler]) -> list[Any]:
    pub = KvStream(await connect_cluster(url, "pub"), lambda: scheds)
    ref = KvStream(await connect_cluster(url, "warm"), dict)
    await pub.start()
    await ref.start()
    out = []
    try:
        deadline = time.monotonic() + 30
        total = sum(
            len(s.cached_block_hashes()) + len(s.host_block_hashes()) for s in scheds.values()
        )
        while len(entries(ref.index)) < total:
            assert time.monotonic() < deadline, "the warm index never caught up"
            await asyncio.sleep(0.05)
        want = entries(ref.index)
        for r in range(args.runs):
            fresh = KvStream(await connect_cluster(url, f"restarted-{r}"), dict)
            t0 = time.monotonic()
            await fresh.start()
            t99 = t100 = None
            while t100 is None and time.monotonic() - t0 < 30:
                got = len(entries(fresh.index) & want) / len(want)
                if t99 is None and got >= 0.99:
                    t99 = time.monotonic() - t0
                if got >= 1.0:
                    t100 = time.monotonic() - t0
                await asyncio.sleep(0.01)
            out.append({"run": r, "t99_s": t99, "t100_s": t100, "entries": len(want)})
            print(f"run {r}: 99 % after {t99} s, 100 % after {t100} s", flush=True)
            await fresh.stop()
            await fresh.link.close()
    finally:
        for x in (pub, ref):
            await x.stop()
            await x.link.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--gpu-blocks", type=int, default=512)
    ap.add_argument("--host-blocks", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    scheds = {f"i{k}": warm(args, k) for k in range(args.instances)}
    with NatsServer() as server:
        rows = asyncio.run(measure(args, server.url, scheds))
    t99 = [r["t99_s"] for r in rows if r["t99_s"] is not None]
    print(
        f"{args.instances} instances, {rows[0]['entries']:,} indexed (instance, tier, hash) "
        f"entries: 99 % back after {max(t99) if t99 else float('nan'):.2f} s at worst "
        f"({len(t99)}/{len(rows)} runs reached it)"
    )
    write_json(
        args.json,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
