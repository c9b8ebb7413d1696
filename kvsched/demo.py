"""`make demo` / `kvsched demo`: the daemon and four simulated H100 workers replay the first 60 s
of the Mooncake conversation trace (the slice shipped in kvsched/data/) at its real arrival
times, then print a summary table and the paths of its JSON and plots. `--cluster` (`make
demo-cluster`) runs the same workers under several daemons joined through a local NATS, the
trace's requests spread over the daemons.

In its first 60 s the trace offers about 2.9 H100-seconds of work per second, so one H100 would be ~3x overloaded
and its queue would grow without bound; four keep each about 75 % busy, the load the SLOs are
meant for (kvsched/data/README.md). The simulation runs `--time-scale` times faster than real
time (arrivals compressed and the workers' --speed raised by the same factor): every figure it
prints is in simulated H100 seconds, as if run in real time.

Everything it writes goes to one run folder, `runs/demo-<UTC time>/` under the current
directory (`--out DIR` to choose; `runs/` is ignored by git): the summary JSON and the plots.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvsched.replay.args import add_replay_arguments
from kvsched.replay.main import run_replay


def run_demo(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.exists():
        print(f"kvsched demo: trace {trace} not found (pass --trace PATH)")
        return 2
    workers = f"{args.workers} simulated {args.gpu.upper()} worker" + "s" * (args.workers != 1)
    daemons = 1
    if getattr(args, "cluster", False):
        daemons = args.daemons
        workers += f" and {daemons} daemons in one cluster on a local NATS (docs/CLUSTER.md)"
    print(
        f"kvsched demo: replaying {args.duration:g} s of {trace.name} at its real arrival times "
        f"on {workers} (daemon and workers are child processes), "
        f"simulated {args.time_scale:g}x faster than real time; figures are in simulated seconds",
        flush=True,
    )
    out = args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())
    json_path = args.json or out / ("demo_cluster.json" if daemons > 1 else "demo.json")
    print(f"kvsched demo: figures and plots go to {json_path.parent}/", flush=True)
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    replay_args = parser.parse_args(
        [
            "--trace", str(trace), "--duration", str(args.duration), "--embedded",
            "--gpu", args.gpu, "--workers", str(args.workers), "--time-scale",
            str(args.time_scale), "--json", str(json_path), "--daemons", str(daemons),
        ]
        + (["--storage", args.storage] if getattr(args, "storage", None) else [])
    )  # fmt: skip
    replay_args.explain = True
    return run_replay(replay_args)
