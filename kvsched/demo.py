"""`make demo` / `kvsched demo`: the daemon and one simulated H100 worker replay the first 60 s of
the Mooncake conversation trace at its real arrival times, then print a summary table.

One H100 is about 3x overloaded by this trace (shared/data/README.md), so the backlog takes
~5 minutes of simulated time to clear. The demo therefore runs the simulation `--time-scale`
times faster than real time (arrivals compressed and the worker's --speed raised by the same
factor): every figure it prints is in simulated H100 seconds, as if run in real time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsched.replay.main import add_replay_arguments, run_replay


def run_demo(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.exists():
        print(f"kvsched demo: trace {trace} not found (pass --trace PATH)")
        return 2
    print(
        f"kvsched demo: replaying {args.duration:g} s of {trace.name} at its real arrival times "
        f"on one simulated {args.gpu.upper()} worker (daemon and worker are child processes), "
        f"simulated {args.time_scale:g}x faster than real time; figures are in simulated seconds",
        flush=True,
    )
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    replay_args = parser.parse_args(
        [
            "--trace", str(trace), "--duration", str(args.duration), "--embedded",
            "--gpu", args.gpu, "--workers", "1", "--time-scale", str(args.time_scale),
            "--json", str(args.json),
        ]
    )  # fmt: skip
    return run_replay(replay_args)
