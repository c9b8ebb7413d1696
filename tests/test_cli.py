"""The `kvsched` command line: parsing, config errors as one line and exit 2, subcommand wiring."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvsched import cli
from kvsched.server.config.settings import ServerConfig
from kvsched.v1 import admin_service_pb2, admin_service_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Callable[..., Any]) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVSCHED_"):
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def keep_logging() -> Iterator[None]:
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "worker", "status", "demo"):
        assert command in out


@pytest.mark.parametrize("command", ["serve", "worker", "status", "demo"])
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert "usage: kvsched " + command in capsys.readouterr().out


def test_serve_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[instances.a]\nworld_size = 0\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "[instances.a] world_size = 0 is out of range [1, 64]" in err


def test_serve_bad_env_and_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSCHED_HEARTBEAT_TIMEOUT_S", "abc")
    assert cli.main(["serve"]) == 2
    assert "KVSCHED_HEARTBEAT_TIMEOUT_S: 'abc' is not a number" in capsys.readouterr().err
    monkeypatch.delenv("KVSCHED_HEARTBEAT_TIMEOUT_S")
    assert cli.main(["serve", "--listen", "nope"]) == 2
    assert "listen = 'nope' must be HOST:PORT" in capsys.readouterr().err


def test_serve_builds_config_and_runs_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ServerConfig] = []

    def run_server(config: ServerConfig) -> int:
        seen.append(config)
        return 0

    fake_module(monkeypatch, "kvsched.daemon.app", run_server=run_server)
    path = tmp_path / "k.toml"
    path.write_text(
        'listen = "127.0.0.1:1"\nmodel = "toml"\n[engine.scheduler]\nmax_num_seqs = 8\n'
    )
    monkeypatch.setenv("KVSCHED_LISTEN", "127.0.0.1:2")
    monkeypatch.setenv("KVSCHED_METRICS_LISTEN", "127.0.0.1:3")
    argv = ["serve", "--config", str(path), "--listen", "127.0.0.1:0", "--tracing", "console"]
    assert cli.main([*argv, "--metrics-listen", "off", "--log-json"]) == 0
    (config,) = seen
    assert config.listen == "127.0.0.1:0"
    assert config.metrics_listen == ""
    assert config.model == "toml"
    assert config.tracing_exporter == "console"
    assert config.log_json is True
    assert config.engine.scheduler.max_num_seqs == 8


def test_serve_returns_the_daemon_status(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_module(monkeypatch, "kvsched.daemon.app", run_server=lambda config: 3)
    assert cli.main(["serve", "--metrics-listen", "off"]) == 3


def test_worker_passes_the_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    fake_module(monkeypatch, "kvsched.worker_stub.client", run_worker=lambda a: seen.append(a) or 0)
    argv = ["worker", "--server", "h:1", "--instance", "p0", "--rank", "1", "--world-size", "2"]
    assert cli.main([*argv, "--zero-cost", "--num-blocks", "64", "--backend", "numpy"]) == 0
    (args,) = seen
    assert (args.server, args.instance, args.rank, args.world_size) == ("h:1", "p0", 1, 2)
    assert (args.executor, args.gpu, args.speed, args.zero_cost) == ("sim", "h100", 1.0, True)
    assert (args.num_blocks, args.block_size, args.num_slots, args.seed) == (64, 0, 256, 0)
    assert (args.backend, args.listen_kv, args.token, args.tls_ca) == ("numpy", "", "", "")
    assert (args.tls_cert, args.tls_key, args.log_level) == ("", "", "info")


def test_demo_default_trace_is_the_shipped_mooncake_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    fake_module(monkeypatch, "kvsched.demo", run_demo=lambda a: seen.append(a) or 0)
    assert cli.main(["demo"]) == 0
    (args,) = seen
    assert (args.duration, args.gpu) == (60.0, "h100")
    expected = REPO / "kvsched/data/mooncake_conversation_slice.jsonl"
    assert args.trace == expected


# --- status against a real AdminService ---------------------------------------------------------


class FakeAdmin(admin_service_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.requests: list[str] = []

    def GetStatus(self, request: Any, context: Any) -> admin_service_pb2.GetStatusResponse:
        self.metadata.append(dict(context.invocation_metadata()))
        self.requests.append(request.instance_id)
        return admin_service_pb2.GetStatusResponse(
            num_waiting=4,
            instances=[admin_service_pb2.InstanceStatus(instance_id="i0", ready=True, role=1)],
        )


@pytest.fixture
def admin() -> Iterator[tuple[FakeAdmin, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = FakeAdmin()
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_status_prints_the_table(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, address = admin
    assert cli.main(["status", "--server", address, "--token", "s3cret", "--instance", "i0"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:3] == ["i0", "mixed", "ready"]
    assert "daemon: serving; waiting 4" in out
    assert servicer.metadata[0]["authorization"] == "Bearer s3cret"
    assert servicer.requests == ["i0"]


def test_status_watch_until_ctrl_c(
    admin: tuple[FakeAdmin, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servicer, address = admin
    sleeps: list[float] = []

    def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_sleep", fake_sleep)
    assert cli.main(["status", "--server", address, "--watch", "0.5"]) == 0
    assert sleeps == [0.5, 0.5]
    assert len(servicer.requests) == 2
    assert capsys.readouterr().out.count("daemon: serving") == 2


def test_status_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--server", "127.0.0.1:1", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvsched status: 127.0.0.1:1: UNAVAILABLE") and "Traceback" not in err


# --- the installed command ----------------------------------------------------------------------


def _command() -> list[str]:
    script = Path(sys.executable).parent / "kvsched"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvsched.cli"]


def test_installed_command(tmp_path: Path) -> None:
    help_run = subprocess.run([*_command(), "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "serve" in help_run.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('tracing_exporter = "jaeger"\n')
    env = {"PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [*_command(), "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"kvsched serve: configuration error: tracing_exporter = 'jaeger'; expected one of "
        f"['none', 'console', 'otlp'] (from {bad})"
    ]


def test_demo_runs_end_to_end_and_prints_its_table(tmp_path: Path) -> None:
    """`kvsched demo` (what `make demo` runs), on a few seconds of the trace, sped up."""
    out = tmp_path / "demo.json"
    res = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "demo", "--duration", "4", "--time-scale", "5",
         "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    for needle in ("requests (completed)", "output tokens/s", "TTFT p50 / p99", "TPOT p50 / p99",
                   "prefix-cache hit", "preemptions"):  # fmt: skip
        assert needle in res.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == summary["requests"] > 0


def test_serve_itl_target_flag_sets_every_instance_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[ServerConfig] = []

    def run_server(config: ServerConfig) -> int:
        seen.append(config)
        return 0

    fake_module(monkeypatch, "kvsched.daemon.app", run_server=run_server)
    monkeypatch.setenv("KVSCHED_ENGINE__STEP_COST__FORGETTING", "0.9")
    assert cli.main(["serve", "--listen", "127.0.0.1:0", "--itl-target-ms", "40"]) == 0
    (config,) = seen
    assert config.engine.scheduler.itl_target_ms == 40.0
    assert config.engine.step_cost.forgetting == 0.9
    assert cli.main(["serve", "--itl-target-ms", "-1"]) == 2  # a ConfigError naming the field


def test_serve_encoder_cache_flag_sets_every_instance_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[ServerConfig] = []

    def run_server(config: ServerConfig) -> int:
        seen.append(config)
        return 0

    fake_module(monkeypatch, "kvsched.daemon.app", run_server=run_server)
    assert cli.main(["serve", "--listen", "127.0.0.1:0", "--encoder-cache-size", "8192"]) == 0
    (config,) = seen
    assert config.engine.cache.encoder_cache_size == 8192
    assert cli.main(["serve", "--encoder-cache-size", "-1"]) == 2  # a ConfigError naming the field
