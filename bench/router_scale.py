"""A cluster routing decision at fleet scale: 1,000 peer instances known from KV events, while
the index ingests 50,000 events per second, all on one core (issue 25).

    .venv/bin/python -m bench.router_scale [--instances 1000] [--events-per-s 50000]
        [--decisions-per-s 1000] [--seconds 10] [--prompt-blocks 128] [--json OUT]

What runs is kvsched's own code: `ClusterIndex` (kvsched/cluster/kv_index.py) fed with JSON
batches in the wire format (decoded and applied here: the cost of a subscriber), and
`ClusterRouter.route` (kvsched/cluster/routing.py) over a real `InstanceRegistry` with no
local instance, so every candidate is a peer's. The fleet: instances of 4 per daemon, block
size 16; 4,000 conversations whose prompts start with one shared 8-block system prompt (every
instance holds it: the worst case for the index, every instance continues past the first
block); each instance holds some conversations in its GPU pool and others in host memory.
The event stream: per instance, in turn, batches of 5 events of ~`--blocks-per-event` blocks
(two gpu BlockStored of a conversation's blocks, the oldest GPU blocks evicted: a gpu
BlockRemoved and a cpu BlockStored of the same blocks, the oldest host blocks evicted: a cpu
BlockRemoved), pre-encoded so that only the subscriber's side is timed.

One thread interleaves them at the target rates: before each decision it applies the batches
due by then; a decision is timed alone (perf_counter around `route`), with the prompt's block
hashes given (computed once per request by whoever hashes the prompt: their cost, per prompt
length, is its own column). `busy` is the share of the core both need at the target rates:
(decisions/s x mean decision + events/s x mean cost per event) / 1 s; below 100 % one core
keeps up. Times are CPU time of the thread (`time.thread_time`), the fair figure on a shared
machine where the wall clock also counts the other jobs' turns (wall-clock p50/p99 are in the
JSON beside them); the setup's objects are frozen out of the garbage collector first. Restore: the index rebuilt from every instance's snapshot (decode + apply, in bulk:
`ClusterIndex.apply_snapshots`, as `KvStream` applies the snapshots that arrive together; beside
it, `one by one`: each snapshot applied alone, on an index of its own), the CPU part of a
restarted daemon's catch-up (docs/BENCHMARKS.md for the network part).
Writes bench/results/router_scale.json. Timings are real time on a shared machine: noisy.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench.policies import write_json  # noqa: E402
from kvsched.cluster.kv_index import ClusterIndex, decode, encode_batch, encode_snapshot  # noqa: E402
from kvsched.cluster.routing import ClusterRouter  # noqa: E402
from kvsched.core import KVCacheManager, Request, SamplingParams  # noqa: E402
from kvsched.core.kv_events import CPU, GPU, BlockRemoved, BlockStored, KvEvent  # noqa: E402
from kvsched.server.config.settings import ServerConfig  # noqa: E402
from kvsched.server.instances.registry import InstanceRegistry  # noqa: E402
from kvsched.server.telemetry.hooks import Telemetry  # noqa: E402

BS = 16
SYSTEM_BLOCKS = 8
DEFAULT_JSON = _REPO / "bench" / "results" / "router_scale.json"


def chain(hasher: KVCacheManager, tokens: list[int]) -> list[bytes]:
    req = Request("h", tokens, SamplingParams(max_tokens=1))
    hasher.ensure_hashes(req, len(tokens) // BS)
    return req.block_hashes


class Fleet:
    """Conversations, which instance holds which, and the event stream that churns them."""

    def __init__(self, args: argparse.Namespace, prompt_blocks: int, rng: random.Random) -> None:
        self.rng = rng
        self.n = args.instances
        hasher = KVCacheManager(BS, 0)
        gen = np.random.default_rng(rng.randrange(1 << 30))
        system = gen.integers(3, 30000, SYSTEM_BLOCKS * BS).tolist()
        self.tokens: list[list[int]] = []
        self.chains: list[list[bytes]] = []
        for _ in range(args.conversations):
            nb = max(1, int(rng.lognormvariate(np.log(prompt_blocks), 0.5)))
            toks = system + gen.integers(3, 30000, nb * BS).tolist()
            self.tokens.append(toks)
            self.chains.append(chain(hasher, toks))
        self.load = {"running": 8.0, "waiting": 1.0, "max_num_seqs": 256.0, "kv_usage": 0.5}
        self.load |= {"prefill_token_ms": 0.06, "attention_ms": 2e-7, "swap_block_ms": 0.05}
        # Per instance: conversations in GPU, in host memory (oldest first), the next seq.
        self.gpu: list[list[int]] = []
        self.host: list[list[int]] = []
        for _ in range(self.n):
            picks = rng.sample(range(len(self.chains)), args.gpu_convs + args.host_convs)
            self.gpu.append(picks[: args.gpu_convs])
            self.host.append(picks[args.gpu_convs :])
        self.seq = [0] * self.n
        self.per_event = args.blocks_per_event
        # The same contents as block queues, oldest first (what the event stream churns).
        self.gpu_q = [
            collections.deque(h for c in self.gpu[i] for h in self.chains[c][SYSTEM_BLOCKS:])
            for i in range(self.n)
        ]
        self.host_q = [
            collections.deque(h for c in self.host[i] for h in self.chains[c][SYSTEM_BLOCKS:])
            for i in range(self.n)
        ]

    def iid(self, i: int) -> str:
        return f"i{i}"

    def daemon(self, i: int) -> str:
        return f"d{i // 4}"

    def snapshot(self, i: int) -> bytes:
        gpu = {h for c in self.gpu[i] for h in self.chains[c]}
        host = {h for c in self.host[i] for h in self.chains[c][SYSTEM_BLOCKS:]}
        return encode_snapshot(
            self.iid(i),
            self.daemon(i),
            "e",
            self.seq[i],
            BS,
            self.load,
            list(gpu),
            host_hashes=list(host),
        )

    def batch(self, i: int) -> tuple[bytes, int]:
        """The next batch of instance i, 5 events of about `blocks_per_event` blocks each: two
        gpu BlockStored (a conversation's next blocks), its oldest GPU blocks evicted (gpu
        BlockRemoved) and written to host memory (cpu BlockStored), its oldest host blocks
        evicted (cpu BlockRemoved). The instance's GPU and host contents stay the same size."""
        rng = self.rng
        ev: list[KvEvent] = []
        gpu, host = self.gpu_q[i], self.host_q[i]
        moved: list[bytes] = []
        for _ in range(2):
            k = rng.randrange(1, 2 * self.per_event)
            c = rng.randrange(len(self.chains))
            ch = self.chains[c][SYSTEM_BLOCKS:]
            at = rng.randrange(max(1, len(ch) - k))
            new = ch[at : at + k]
            ev.append(BlockStored(new, ch[at - 1] if at else None, [], BS, None, GPU))
            gpu.extend(new)
            moved.extend(gpu.popleft() for _ in range(min(len(new), len(gpu))))
        ev.append(BlockRemoved(moved, GPU))
        ev.append(BlockStored(moved, None, [], BS, None, CPU))
        host.extend(moved)
        ev.append(BlockRemoved([host.popleft() for _ in range(min(len(moved), len(host)))], CPU))
        self.seq[i] += 1
        data = encode_batch(self.iid(i), self.daemon(i), "e", self.seq[i], 0.0, BS, self.load, ev)
        return data, len(ev)

    def request(self, k: int) -> tuple[Request, dict[int, list[bytes]]]:
        """A new turn of a conversation (Zipf-like popularity): its prompt plus 2-8 new blocks."""
        c = min(len(self.tokens) - 1, int(self.rng.paretovariate(1.2)) - 1)
        c = (c * 7919 + k) % len(self.tokens) if self.rng.random() < 0.5 else c
        tail = list(range(1000 + k, 1000 + k + self.rng.randrange(2, 9) * BS))
        toks = self.tokens[c] + tail
        req = Request(f"r{k}", toks, SamplingParams(max_tokens=16))
        hasher = KVCacheManager(BS, 0)
        t0 = time.perf_counter()
        hashes = chain(hasher, toks[:-1])
        self.hash_s.append(time.perf_counter() - t0)
        return req, {BS: hashes}

    hash_s: list[float] = []


def run(args: argparse.Namespace, prompt_blocks: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    fleet = Fleet(args, prompt_blocks, rng)
    fleet.hash_s = []
    index = ClusterIndex()
    t0 = time.perf_counter()
    snaps = [fleet.snapshot(i) for i in range(fleet.n)]
    build_s = time.perf_counter() - t0
    owners = {fleet.iid(i): fleet.daemon(i) for i in range(fleet.n)}
    addresses = {d: f"127.0.0.1:{7000 + k}" for k, d in enumerate(sorted(set(owners.values())))}
    router = ClusterRouter(
        "me", InstanceRegistry(ServerConfig(), Telemetry()), index, addresses, owners
    )
    # Pre-encode the event stream (the publishers' side is not timed).
    total = int(args.events_per_s * args.seconds)
    batches: list[tuple[bytes, int]] = []
    got, i = 0, 0
    while got < total:
        data, k = fleet.batch(i % fleet.n)
        batches.append((data, k))
        got += k
        i += 1
    reqs = [fleet.request(k) for k in range(int(args.decisions_per_s * args.seconds))]
    per_decision = total / max(1, len(reqs))  # events due before each decision
    now = time.monotonic()
    # The restore one snapshot at a time (as before issue 25's bulk restore), on an index of
    # its own, for the side-by-side ratio; then the run's index in bulk (`apply_snapshots`,
    # as `KvStream` applies the snapshots that arrive together after a restart).
    c1 = time.thread_time()
    alone = ClusterIndex()
    for data in snaps:
        alone.apply_snapshot(decode(data), now)
    restore_one_cpu_s = time.thread_time() - c1
    del alone
    gc.collect()
    gc.freeze()  # the bench's own objects (fleet, batches, requests): not the daemon's cost
    t1, c1 = time.perf_counter(), time.thread_time()
    index.apply_snapshots([decode(data) for data in snaps], now)
    restore_s = time.perf_counter() - t1
    restore_cpu_s = time.thread_time() - c1
    # The bench's clock runs slower than the rates it plays (a shared machine): no peer goes
    # stale on it. The setup's objects live for the whole run: keep the collector off them.
    router.stale_s = float("inf")
    # What one full collection costs with this index alive (the daemon does no gc tuning):
    # the index's key containers are dicts the collector does not track (`hit_index.KeySet`).
    t1 = time.perf_counter()
    gc.collect()
    full_gc_ms = 1e3 * (time.perf_counter() - t1)
    gc.freeze()
    decide_s: list[float] = []
    decide_cpu: list[float] = []
    ingest_cpu = 0.0
    ingest_s = 0.0
    applied, due, b = 0, 0.0, 0
    remote = 0
    for req, hashes in reqs:
        due += per_decision
        t, c = time.perf_counter(), time.thread_time()
        mono = time.monotonic()
        while applied < due and b < len(batches):
            data, k = batches[b]
            index.apply_batch(decode(data), mono)
            applied += k
            b += 1
        ingest_s += time.perf_counter() - t
        ingest_cpu += time.thread_time() - c
        t, c = time.perf_counter(), time.thread_time()
        out = router.route(req, hashes_by_size=hashes)
        decide_cpu.append(time.thread_time() - c)
        decide_s.append(time.perf_counter() - t)
        remote += out.__class__.__name__ == "RemoteInstance"
    # The model check the accept path runs before routing (`registry.model_for`, which reads the
    # peers' ready models), timed alone after the run.
    registry = router.registry
    registry.peer_ready_models = router.peer_ready_models
    model_us = []
    for _ in range(200):
        c = time.thread_time()
        registry.model_for("")
        model_us.append(1e6 * (time.thread_time() - c))
    gc.unfreeze()
    xs = np.array(decide_cpu) * 1e6
    wall = np.array(decide_s) * 1e6
    per_event_us = 1e6 * ingest_cpu / max(1, applied)
    busy = (args.decisions_per_s * xs.mean() + args.events_per_s * per_event_us) / 1e6
    hs = np.array(fleet.hash_s) * 1e6
    return {
        "instances": fleet.n,
        "prompt_blocks": prompt_blocks,
        "prompt_tokens_mean": float(np.mean([len(r.prompt_token_ids) for r, _ in reqs])),
        "decisions": len(reqs),
        "events": applied,
        "decision_us": {
            "p50": float(np.percentile(xs, 50)),
            "p99": float(np.percentile(xs, 99)),
            "max": float(xs.max()),
        },
        "decision_wall_us": {
            "p50": float(np.percentile(wall, 50)),
            "p99": float(np.percentile(wall, 99)),
        },
        "ingest_us_per_event": per_event_us,
        "ingest_wall_us_per_event": 1e6 * ingest_s / max(1, applied),
        "busy_frac": busy,
        "hash_us": {"p50": float(np.percentile(hs, 50)), "p99": float(np.percentile(hs, 99))},
        "routed_to_peer": remote,
        "indexed_hashes": sum(len(v.hashes) + len(v.host) for v in index.instances.values()),
        "restore_s": restore_s,
        "restore_cpu_s": restore_cpu_s,
        "restore_one_by_one_cpu_s": restore_one_cpu_s,
        "snapshot_encode_s": build_s,
        "full_gc_ms": full_gc_ms,
        "model_for_us": {"p50": float(np.percentile(model_us, 50))},
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'instances':>9} {'prompt tok':>10} {'decision p50':>12} {'p99 us':>8} {'max':>7} "
        f"{'us/event':>8} {'busy':>6} {'hash p50 us':>11} {'restore s':>9} {'one by one':>10} "
        f"{'full gc ms':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r["decision_us"]
        lines.append(
            f"{r['instances']:>9} {r['prompt_tokens_mean']:>10.0f} {d['p50']:>12.0f} "
            f"{d['p99']:>8.0f} {d['max']:>7.0f} {r['ingest_us_per_event']:>8.2f} "
            f"{100 * r['busy_frac']:>5.0f}% {r['hash_us']['p50']:>11.0f} "
            f"{r['restore_cpu_s']:>9.2f} {r['restore_one_by_one_cpu_s']:>10.2f} "
            f"{r.get('full_gc_ms', float('nan')):>10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--events-per-s", type=float, default=50_000)
    ap.add_argument("--decisions-per-s", type=float, default=1_000)
    ap.add_argument("--seconds", type=float, default=10.0, help="of the target rates")
    ap.add_argument("--prompt-blocks", default="128", help="median prompt, 16-token blocks")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--gpu-convs", type=int, default=6, help="conversations per instance GPU")
    ap.add_argument("--host-convs", type=int, default=12, help="... in its host memory")
    ap.add_argument("--blocks-per-event", type=int, default=4, help="mean blocks per event")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    rows = []
    for pb in [int(x) for x in args.prompt_blocks.split(",")]:
        rows.append(run(args, pb))
        print(f"prompt {pb} blocks: done", flush=True)
    print(table(rows))
    print(
        f"({args.events_per_s:,.0f} KV events/s and {args.decisions_per_s:,.0f} decisions/s "
        "on one thread; decision: ClusterRouter.route with the prompt's hashes given; busy: "
        "the core's share both need at those rates; hash: the prompt's chained hashes, once "
        "per request; restore: every instance's snapshot decoded and applied, in bulk; one by "
        "one: each applied alone)"
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
