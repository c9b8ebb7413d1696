"""`kvsched http`: its arguments (registered into kvsched's CLI by `add_http_parser`) and its
entry point. Imports FastAPI, uvicorn and transformers only when the command runs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvsched import heap

DEFAULT_LISTEN = "127.0.0.1:8000"


def add_http_parser(sub: Any) -> None:
    """Register `kvsched http` (every option's help says its default)."""
    p = sub.add_parser(
        "http",
        help="OpenAI-compatible HTTP front end (needs the 'http' extra)",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models over kvsched's "
        "gRPC API (docs/HTTP.md).",
    )
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"HTTP address; port 0 picks one (default {DEFAULT_LISTEN})",
    )
    p.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="ADDR[,ADDR...]",
        help="kvsched daemon(s); several: requests are spread over them and a broken stream is "
        "resumed through the next one (default 127.0.0.1:50051)",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="model directory with tokenizer.json (required, no default)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="name(s) clients use for the model, repeatable (default: --model as given)",
    )
    p.add_argument(
        "--daemon-model",
        default="",
        metavar="NAME",
        help="GenerateRequest.model for a served name the daemon does not serve by that name "
        "(default: the daemon's default model)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCHED_TOKEN", ""),
        help="bearer token for kvsched when an HTTP request brings none "
        "(default: $KVSCHED_TOKEN, else none)",
    )
    p.add_argument(
        "--tls-ca",
        default="",
        metavar="FILE",
        help="CA that signed the daemon (default: plaintext)",
    )
    p.add_argument(
        "--tls-cert", default="", metavar="FILE", help="client certificate, mTLS (default: none)"
    )
    p.add_argument("--tls-key", default="", metavar="FILE", help="client key, mTLS (default: none)")
    p.add_argument(
        "--retry-for-s",
        type=float,
        default=10.0,
        metavar="S",
        help="how long a request keeps trying the daemons when they are unreachable (default 10)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=1,
        metavar="N",
        help="Session streams per daemon address (and bearer token) that requests are spread "
        "over (default 1)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="uvicorn's log level (default info)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (vLLM\'s flag; needs --tool-call-parser; default off: 400)',
    )
    p.add_argument(
        "--tool-call-parser",
        default="",
        metavar="NAME",
        help='vLLM\'s tool parser for "auto" tool calls, e.g. hermes (needs vLLM installed; '
        "default none)",
    )
    p.set_defaults(func=run_http)


def run_http(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Exit 2 when the extra is missing or an argument is bad."""
    try:
        import uvicorn

        from kvsched.http.backend import Backend
        from kvsched.http.routes import Settings, create_app
    except ImportError as exc:
        print(f"kvsched http: {exc.name} is missing: pip install 'kvsched[http]'", file=sys.stderr)
        return 2
    if not os.path.isdir(args.model):  # a local directory: nothing is downloaded
        print(f"kvsched http: --model {args.model!r} is not a directory", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        print(f"kvsched http: {args.model}: no tokenizer.json (a fast tokenizer)", file=sys.stderr)
        return 2
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"kvsched http: --listen must be HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice != bool(args.tool_call_parser):
        print(
            "kvsched http: --enable-auto-tool-choice and --tool-call-parser go together",
            file=sys.stderr,
        )
        return 2
    addresses = [a.strip() for a in args.server.split(",") if a.strip()]
    settings = Settings(
        model_dir=args.model,
        served_names=args.served_model_name or [args.model],
        daemon_model=args.daemon_model,
        tool_call_parser=args.tool_call_parser,
        backend=lambda: Backend(
            addresses,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            retry_for_s=args.retry_for_s,
            sessions=args.sessions,
        ),
    )
    try:
        app = create_app(settings)
    except (OSError, ValueError) as exc:
        print(f"kvsched http: {args.model}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app, host=host, port=int(port), log_level=args.log_level, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    _announce(server, settings)
    server.run()
    return 0


def _announce(server: Any, settings: Any) -> None:
    """Print the bound address once listening (port 0 picks one), as `kvsched serve` does."""
    startup = server.startup

    async def startup_and_say(sockets: Any = None) -> None:
        await startup(sockets=sockets)
        heap.freeze_after_start()
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                names = ", ".join(settings.served_names)
                print(f"kvsched http listening on {host}:{port} serving {names}", flush=True)

    server.startup = startup_and_say
