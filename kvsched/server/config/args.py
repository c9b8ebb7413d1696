"""`kvsched serve`: its arguments, registered into kvsched's CLI by `add_serve_parser` (every
option's help says its default; each overrides the TOML file and `KVSCHED_*`). Imports nothing
of kvsched (the package's `__init__` is empty), so building the parser stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def add_serve_parser(
    sub: Any, default_server: str, log_levels: tuple[str, ...], func: Callable[..., int]
) -> None:
    """Register `kvsched serve`; `func` runs it."""
    p = sub.add_parser("serve", help="run the daemon", description="Run the kvsched daemon.")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file (see examples/kvsched.toml; default: $KVSCHED_CONFIG, else none)",
    )
    p.add_argument(
        "--listen", metavar="HOST:PORT", help=f"gRPC address (default: {default_server})"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help='Prometheus address; "off" disables (default: 127.0.0.1:9464)',
    )
    p.add_argument("--log-level", choices=log_levels, help="log threshold (default: info)")
    p.add_argument(
        "--log-json", action="store_true", default=None, help="JSON lines logs (default: text)"
    )
    p.add_argument(
        "--auth-file", metavar="FILE", help="tokens and their permissions (default: no auth)"
    )
    p.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM; default: no TLS)")
    p.add_argument("--tls-key", metavar="FILE", help="server private key (PEM; default: no TLS)")
    p.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="require client certs from this CA (default: none required)",
    )
    p.add_argument(
        "--tracing",
        "--tracing-exporter",
        dest="tracing_exporter",
        choices=("none", "console", "otlp"),
        help="OpenTelemetry exporter (default: none, or $OTEL_TRACES_EXPORTER)",
    )
    p.add_argument(
        "--host-write-policy",
        choices=("write_through", "write_through_selective", "write_back"),
        help="when KV blocks are copied to a worker's host tier, every instance "
        "(engine.cache.host_write_policy; default write_back)",
    )
    p.add_argument(
        "--storage",
        metavar="URL",
        help='the shared storage KV tier: "mooncake" (a Mooncake master at its default '
        "address) or mooncake://HOST:PORT (default: none; docs/STORAGE.md)",
    )
    p.add_argument(
        "--storage-write-policy",
        choices=("write_back", "write_through"),
        help="when KV blocks are written to the storage tier, every instance "
        "(engine.cache.storage_write_policy; default write_back: on eviction)",
    )
    p.add_argument(
        "--encoder-cache-size",
        type=int,
        metavar="N",
        help="multimodal encoder outputs a worker keeps, in embeddings, every instance "
        "(engine.cache.encoder_cache_size; default 0: off)",
    )
    p.add_argument(
        "--itl-target-ms",
        type=float,
        metavar="MS",
        help="time budget of a worker step while requests decode, every instance "
        "(engine.scheduler.itl_target_ms; default 100; 0: off)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the model's tokenizer directory, for a gateway (smg) in front: its GetModelInfo "
        "names it, its GetTokenizer sends it (default: none; docs/GATEWAY.md)",
    )
    p.add_argument(
        "--cluster",
        metavar="NATS_URL",
        help="join a cluster: nats://HOST:PORT (default: none, a standalone daemon)",
    )
    p.add_argument(
        "--daemon-id",
        metavar="ID",
        help="this daemon's id in the cluster (default: derived from the listen address)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="address peers and workers reach this daemon at (default: the listen address)",
    )
    p.add_argument(
        "--take-over",
        metavar="ID",
        help="also take over this dead daemon's unfinished requests from the journal "
        "(default: none)",
    )
    p.add_argument(
        "--cluster-fallback",
        choices=("fail", "standalone"),
        help="NATS unreachable at start: fail (default) or run standalone",
    )
    p.add_argument(
        "--cluster-token",
        metavar="TOKEN",
        help="bearer token (role client) sent to peer daemons when forwarding requests "
        "(default: none)",
    )
    p.set_defaults(func=func)
