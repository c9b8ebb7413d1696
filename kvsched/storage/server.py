"""A local Mooncake Store for development (`kvsched mooncake`) and tests: the wheel's
`mooncake_master` with its built-in HTTP metadata server, and one `mooncake_client` that lends
the store its memory (the store's capacity; the master evicts when it is full).

Everything listens on loopback ports chosen free unless given. Production runs its own master
(and segment holders) and points `kvsched serve --storage mooncake://MASTER` at it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import IO

from kvsched.core.errors import ConfigError
from kvsched.storage.client import StoreAddress

DEFAULT_CAPACITY_BYTES = 1 << 30


def find_binary(name: str) -> str:
    """A Mooncake executable: beside this Python's scripts first (the wheel installs them
    there), then on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(
            f"{name} not found: install the storage extra (`pip install 'kvsched[storage]'`, "
            "the mooncake-transfer-engine-non-cuda wheel) or put it on PATH"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeServer:
    """A master and one segment holder on loopback; a context manager. `url` is what
    `--storage` and Welcome.storage_url take. `kill_master()` / `start_master()` let tests
    take the store down and bring it back (empty: the master keeps no data of its own);
    `pause_master()` / `resume_master()` make it hang and go on."""

    def __init__(
        self,
        port: int = 0,
        metadata_port: int = 0,
        host: str = "127.0.0.1",
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        log_dir: str | None = None,
    ) -> None:
        if capacity_bytes < 1 << 20:
            raise ConfigError(f"store capacity must be >= 1 MiB, got {capacity_bytes} bytes")
        self.host = host
        self.port = port or free_port(host)
        self.metadata_port = metadata_port or free_port(host)
        self.metrics_port = free_port(host)
        self.holder_port = free_port(host)
        self.capacity_bytes = capacity_bytes
        self._tmp = None if log_dir else tempfile.mkdtemp(prefix="kvsched-mooncake-")
        self.log_dir = log_dir or self._tmp or ""
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def address(self) -> StoreAddress:
        return StoreAddress(self.host, self.port, self.host, self.metadata_port)

    @property
    def url(self) -> str:
        return self.address.url

    def master_command(self) -> list[str]:
        return [
            find_binary("mooncake_master"),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.metadata_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            "-rpc_thread_num=2",
            "-logtostderr",
            "-minloglevel=1",
        ]

    def holder_command(self) -> list[str]:
        a = self.address
        return [
            find_binary("mooncake_client"),
            f"-host={self.host}",
            f"-port={self.holder_port}",
            f"-global_segment_size={self.capacity_bytes}",
            "-local_buffer_size=16777216",
            f"-master_server_address={a.master}",
            f"-metadata_server={a.metadata_url}",
            "-protocol=tcp",
            "-logtostderr",
            "-minloglevel=1",
        ]

    def start(self, timeout_s: float = 20.0) -> MooncakeServer:
        try:
            self.start_master(timeout_s)
            self.holder = self._spawn("holder", self.holder_command())
            self._wait_listening(self.holder, "mooncake_client", self.holder_port, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self, timeout_s: float = 20.0) -> None:
        self.master = self._spawn("master", self.master_command())
        self._wait_listening(self.master, "mooncake_master", self.port, timeout_s)
        self._wait_listening(self.master, "mooncake_master", self.metadata_port, timeout_s)

    def restart(self, timeout_s: float = 20.0) -> None:
        """A fresh, empty store on the same ports: the master (if it is not running) and the
        holder, which must mount its memory with the new master."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.terminate()
            self.holder.wait(5)
        self.holder = None
        if self.master is None or self.master.poll() is not None:
            self.start_master(timeout_s)
        self.holder = self._spawn("holder", self.holder_command())
        self._wait_listening(self.holder, "mooncake_client", self.holder_port, timeout_s)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash); the holder stays up, the store is unreachable."""
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait(5)
        self.master = None

    def pause_master(self) -> None:
        """SIGSTOP the master (a hung store: the kernel still accepts its connections, nothing
        answers them); `resume_master` lets it go on."""
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGSTOP)

    def resume_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGCONT)

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(Path(self.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def _wait_listening(
        self, proc: subprocess.Popen[bytes], name: str, port: int, timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ConfigError(
                    f"{name} exited at start (status {proc.returncode}); see "
                    f"{self.log_dir}: {self._log_tail()}"
                )
            try:
                with socket.create_connection((self.host, port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise ConfigError(f"{name} did not listen on {self.host}:{port} in {timeout_s} s")

    def _log_tail(self) -> str:
        tails = []
        for path in sorted(Path(self.log_dir).glob("*.log")):
            text = path.read_text(errors="replace").strip()
            tails.append(f"{path.name}: {text[-400:]}")
        return " | ".join(tails)

    def stop(self) -> None:
        self.resume_master()  # a paused master would not act on SIGTERM
        for proc in (self.holder, self.master):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self.holder = self.master = None
        for f in self._logs:
            f.close()
        self._logs.clear()

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> MooncakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_size(text: str) -> int:
    """'1GB', '512 MiB', '1048576' as bytes (K/M/G/T, powers of 1024); ConfigError otherwise."""
    t = text.strip().upper().replace(" ", "").removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    try:
        value = float(digits)
    except ValueError as e:
        raise ConfigError(f"not a size: {text!r} (e.g. 4GB, 512MB)") from e
    return int(value * scale)


def run_mooncake(host: str, port: int, metadata_port: int, capacity: str) -> int:
    """`kvsched mooncake`: a master and a segment holder in the foreground until SIGINT or
    SIGTERM; prints the store's URL."""
    server = MooncakeServer(port, metadata_port, host, parse_size(capacity))
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.start()
    print(
        f"kvsched mooncake: store at {server.url} ({server.capacity_bytes >> 20} MiB; "
        f"logs in {server.log_dir}); pass --storage {server.url}",
        flush=True,
    )
    try:
        while not stopping:
            for proc, name in ((server.master, "master"), (server.holder, "holder")):
                if proc is not None and proc.poll() is not None:
                    print(f"kvsched mooncake: the {name} exited ({proc.returncode})", flush=True)
                    return 1
            time.sleep(0.2)
    finally:
        server.close()
    return 0
