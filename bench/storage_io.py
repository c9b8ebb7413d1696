"""Put and get throughput of the storage tier's client (kvsched.storage.MooncakeStore) for
KV-block-sized values, against a local Mooncake Store over TCP on loopback (issue 25).

    .venv/bin/python -m bench.storage_io [--sizes 64K,512K,2M] [--batches 1,8,32]
        [--rounds 5] [--capacity 1GB] [--json OUT]

`kvsched mooncake`'s store (mooncake_master + one segment holder lending --capacity) runs on
free loopback ports; one client (as a worker connects: no memory of its own) puts `batch`
values of `size` random bytes per call (put_many: one put_batch), then gets them back
(get_many: one get_batch), `--rounds` times with fresh keys; values are checked on the way back.
2M is one block of Llama-3-8B at block size 16 (32 layers x 8 KV heads x 128 dims x K,V x
2 bytes x 16 tokens); the sim's default --storage-gbps (12.5) stands for RDMA, which this box
has not. Wall-clock on a shared 2-core machine: noisy; the master, the holder and the client
share the cores. Writes bench/results/storage_io.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from bench.policies import write_json  # noqa: E402
from kvsched.storage import MooncakeStore  # noqa: E402
from kvsched.storage.server import MooncakeServer, parse_size  # noqa: E402

DEFAULT_JSON = _REPO / "bench" / "results" / "storage_io.json"


def measure(
    store: MooncakeStore, size: int, batch: int, rounds: int, tag: str, loop: bool = False
) -> dict[str, Any]:
    """put_many then get_many of `batch` values, `rounds` times; loop: one put / get call per
    value instead (the batch calls' baseline)."""
    put_s: list[float] = []
    get_s: list[float] = []
    failed = 0
    for r in range(rounds):
        keys = [f"bench/{tag}/{loop:d}/{size}/{batch}/{r}/{i}" for i in range(batch)]
        values = [os.urandom(size) for _ in range(batch)]
        t0 = time.perf_counter()
        if loop:
            for k, v in zip(keys, values, strict=True):
                store.put(k, v)
        else:
            failed += len(store.put_many(keys, values))
        t1 = time.perf_counter()
        got: list[bytes | None] = [store.get(k) for k in keys] if loop else store.get_many(keys)
        t2 = time.perf_counter()
        if got != values:
            raise AssertionError(f"{size} x {batch}: values came back different")
        put_s.append(t1 - t0)
        get_s.append(t2 - t1)
    moved = size * batch * rounds
    return {
        "size": size,
        "batch": batch,
        "calls": "one per value" if loop else "batch",
        "rounds": rounds,
        "put_gbps": moved / sum(put_s) / 1e9,
        "get_gbps": moved / sum(get_s) / 1e9,
        "put_ms_p50": statistics.median(put_s) * 1e3,
        "get_ms_p50": statistics.median(get_s) * 1e3,
        "put_failed": failed,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64K,512K,2M", help="value sizes (K, M: KiB, MiB)")
    ap.add_argument("--batches", default="1,8,32", help="values per put_many / get_many call")
    ap.add_argument("--rounds", type=int, default=5, help="calls per (size, batch), fresh keys")
    ap.add_argument("--capacity", default="1GB", help="the store's memory (one holder)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    tag = f"{os.getpid()}"
    capacity = parse_size(args.capacity)
    with (
        MooncakeServer(capacity_bytes=capacity) as server,
        MooncakeStore.connect(server.url) as store,
    ):
        measure(store, sizes[0], 1, 2, tag + "w")  # warm up connections
        print(f"store {server.url}, {parse_size(args.capacity) >> 20} MiB, TCP loopback")
        print(
            f"{'size':>8} {'batch':>6} {'calls':>14} {'put GB/s':>9} {'get GB/s':>9} "
            f"{'put ms p50':>11} {'get ms p50':>11} {'failed':>7}"
        )
        for size in sizes:
            for batch in batches:
                for loop in (False, True) if batch > 1 else (False,):
                    row = measure(store, size, batch, args.rounds, tag, loop)
                    rows.append(row)
                    print(
                        f"{size >> 10:>7}K {batch:>6} {row['calls']:>14} "
                        f"{row['put_gbps']:>9.2f} {row['get_gbps']:>9.2f} "
                        f"{row['put_ms_p50']:>11.2f} "
                        f"{row['get_ms_p50']:>11.2f} {row['put_failed']:>7}",
                        flush=True,
                    )
    write_json(
        args.json,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": f"{os.cpu_count()} cores, shared; TCP on loopback",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
