"""What taking the tiers' transfers off the step's critical path can give at most (issue 37
item 2): the simulator of `bench.tier_compare` (virtual time, the daemon's configuration) with
host -> GPU swap-ins, storage fetches or storage -> host prefetches made free.

    python -m bench.tier_bounds [--trace PATH] [--window 0-300] [--configs host-4x,storage]
                                [--json OUT]

Rows per configuration:
    as built      swap-ins and fetches add their time to the next step (PCIe 50 GB/s, storage
                  12.5 GB/s), prefetches and writes run beside it (the step lasts at least as
                  long as they do)
    free swap-in  swap-ins cost nothing: the bound of ordering swap-ins so that no step waits
                  on a copy (issuing each one step early, onto a copy stream)
    free fetch    storage fetches cost nothing: the bound of any prefetch scheme
    free both

If a bound moves TTFT p50 by less than the sim's own spread (`bench.tier_compare
--jitter-seeds`: +-3 % on window 0-300 s), that ordering does not matter on this trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.policies import DEFAULT_TRACE
from bench.storage import window
from bench.tier_compare import CONFIGS, aggregate, run_sim
from kvsched.traces import load_trace
from kvsched.worker_stub.sim import SimExecutor

DEFAULT_JSON = Path(__file__).parent / "results" / "tier_bounds.json"
VARIANTS = {
    "as built": (False, False),
    "free swap-in": (True, False),
    "free fetch": (False, True),
    "free both": (True, True),
}


@contextlib.contextmanager
def free_transfers(swap_ins: bool, fetches: bool) -> Iterator[None]:
    """Make the sim's swap-ins and/or storage fetches take no step time (counted still)."""
    orig_in, orig_st = SimExecutor.swap_in, SimExecutor.storage_copied
    orig_ahead, orig_read = SimExecutor.copies_ahead, SimExecutor.copies_read

    def moved(orig: Any) -> Any:  # copies ahead (`-ahead` configs): only the priced ones move
        def move(self: SimExecutor, swapped: int, fetched: int) -> None:
            orig(self, 0 if swap_ins else swapped, 0 if fetches else fetched)

        return move

    def swap_in(self: SimExecutor, host_ids: list[int], gpu_ids: list[int]) -> None:
        self.num_copied_blocks += len(gpu_ids)

    def storage_copied(self: SimExecutor, num_blocks: int, *, write: bool) -> None:
        if write:
            orig_st(self, num_blocks, write=True)
        else:
            self.num_fetched_blocks += num_blocks

    SimExecutor.copies_ahead = moved(orig_ahead)  # type: ignore[method-assign]
    SimExecutor.copies_read = moved(orig_read)  # type: ignore[method-assign]
    if swap_ins:
        SimExecutor.swap_in = swap_in  # type: ignore[method-assign]
    if fetches:
        SimExecutor.storage_copied = storage_copied  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimExecutor.swap_in = orig_in  # type: ignore[method-assign]
        SimExecutor.storage_copied = orig_st  # type: ignore[method-assign]
        SimExecutor.copies_ahead, SimExecutor.copies_read = orig_ahead, orig_read  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--window", default="0-300", help="START-END in trace seconds")
    ap.add_argument("--configs", default="host-4x,storage", help=f"from {list(CONFIGS)}")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    start, end = map(float, args.window.split("-", 1))
    reqs = window(load_trace(args.trace, duration_s=end), start, end)
    prompt = [len(r.prompt_token_ids) for r in reqs]
    out: dict[str, Any] = {
        "window": args.window,
        "num_requests": len(reqs),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": {},
    }
    rows, base = run_sim(reqs, "gpu-only", args.instances)
    gpu_p50 = base["ttft_s"]["p50"]
    print(f"window {args.window} s, {len(reqs)} requests; gpu-only TTFT p50 {gpu_p50:.3f} s")
    print(f"{'config':14} {'variant':13} {'hit %':>6} {'TTFT p50':>8} {'vs gpu':>7} {'goodput':>7}")
    for name in args.configs.split(","):
        for variant, (swaps, fetches) in VARIANTS.items():
            if fetches and not CONFIGS[name][1]:
                continue  # no storage tier: nothing fetched
            with free_transfers(swaps, fetches):
                rows, summary = run_sim(reqs, name, args.instances)
            agg = aggregate(rows, prompt)
            p50 = summary["ttft_s"]["p50"]
            out["runs"][f"{name}/{variant}"] = {"agg": agg, "summary": summary}
            print(
                f"{name:14} {variant:13} {100 * agg['hit']:>6.1f} {p50:>8.3f} "
                f"{100 * (p50 / gpu_p50 - 1):>+6.0f} % {summary['goodput_rps']:>7.2f}",
                flush=True,
            )
    out["gpu_only"] = {"summary": base}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
