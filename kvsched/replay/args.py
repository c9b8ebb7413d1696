"""The flags of `kvsched replay` (and the demo's replay), kept apart from the replayer so that
building the command line's parser imports neither grpc nor numpy."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvsched.data import CONVERSATION_SLICE

H100_BLOCKS = 5120  # Llama-3-8B KV: 64-token blocks of 8 MiB in 40 GiB (kvsched/data/README.md)
BLOCK_SIZE = 64


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=Path,
        default=CONVERSATION_SLICE,
        help="Mooncake .jsonl or Azure .csv (default: the shipped Mooncake conversation slice)",
    )
    p.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="the daemon, or a cluster's daemons (requests spread round-robin)",
    )
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of the trace (default: all)"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="first N requests, sent as trace-0 ... trace-<N-1> (the ids the summary lists; "
        "default: all)",
    )
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    p.add_argument(
        "--streams",
        type=int,
        default=1,
        metavar="N",
        help="Session streams per daemon, request i on stream i mod N: like N clients, a burst "
        "of arrivals reaches the daemon on N streams at once instead of one message after "
        "another (default: 1)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run this much faster than real time (pair with the workers' --speed)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="OUT",
        help="summary JSON path (default: none written)",
    )
    p.add_argument("--slo-ttft", type=float, default=5.0, help="goodput TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput TPOT SLO, seconds")
    p.add_argument(
        "--embedded", action="store_true", help="start a daemon and simulated workers for this run"
    )
    p.add_argument(
        "--gpu", choices=("h100", "a100"), default="h100", help="embedded: sim cost model"
    )
    p.add_argument("--workers", type=int, default=1, help="embedded: simulated instances")
    p.add_argument(
        "--daemons",
        type=int,
        default=1,
        help="embedded: daemons; more than 1 starts a local NATS and makes them one cluster "
        "(requests are spread over them, docs/CLUSTER.md)",
    )
    p.add_argument("--num-blocks", type=int, default=H100_BLOCKS, help="embedded: KV blocks each")
    p.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        metavar="N",
        help="embedded: KV blocks of each worker's host-memory tier (0: none)",
    )
    p.add_argument(
        "--host-write-policy",
        choices=("write_through", "write_through_selective", "write_back"),
        default=None,
        help="embedded: when blocks are copied to the host tier (default: the daemon's)",
    )
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help='embedded: the daemons\' shared storage KV tier, "mooncake" or mooncake://HOST:PORT '
        "(the sim workers simulate the store, priced by bandwidth; default: none)",
    )
    p.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        metavar="MS",
        help="embedded: the daemon's time budget per worker step while requests decode "
        "(default: the daemon's, 100; 0: off)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCHED_TOKEN", ""),
        help="bearer token (client role; default: $KVSCHED_TOKEN)",
    )
    p.add_argument(
        "--admin-token",
        default="",
        help="bearer token (admin role) for the status figures; default: --token",
    )
    p.add_argument("--tls-ca", default="", metavar="FILE", help="CA that signed the server")
    p.add_argument("--tls-cert", default="", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
