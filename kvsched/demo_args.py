"""The flags of `kvsched demo`, kept apart from the demo (and from cli.py) so that building the
command line's parser imports neither grpc nor numpy."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsched.data import CONVERSATION_SLICE


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the trace to replay")
    p.add_argument("--gpu", choices=("h100", "a100"), default="h100", help="sim cost model")
    p.add_argument(
        "--workers",
        type=int,
        default=4,
        help="simulated instances (4: ~75 %% busy on the default trace's first 60 s)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=CONVERSATION_SLICE,
        metavar="PATH",
        help="Mooncake .jsonl or Azure .csv (the shipped Mooncake conversation slice)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=2.5,
        help="simulate this much faster than real time (figures stay in simulated seconds)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for the summary JSON and plots (default: runs/demo-<UTC time>/)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="OUT",
        help="summary JSON path (default: in --out)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="run several daemons joined through a local NATS (docs/CLUSTER.md); requests are "
        "spread over them",
    )
    p.add_argument("--daemons", type=int, default=2, help="with --cluster: daemons")
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help='a shared storage KV tier behind the workers\' GPU memory: "mooncake" or '
        "mooncake://HOST:PORT (the simulated workers simulate the store; default: none; "
        "docs/STORAGE.md)",
    )
