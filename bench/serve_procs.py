"""Child processes for the serving benchmarks (`bench.vllm_serve`): started with their own
log files and stopped on exit, HTTP readiness, and py-spy profiles of each (recorded and
summarised by own samples)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Child processes, each logging to a file, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the child)
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        p = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
            start_new_session=True,
        )
        self.procs.append((name, p))

    def check(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.procs.clear()


@contextlib.contextmanager
def running(log_dir: Path) -> Iterator[Procs]:
    procs = Procs(log_dir)
    try:
        yield procs
    finally:
        procs.stop()


def wait_http(procs: Procs, url: str, timeout: float = 300.0, want: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            body = r.read().decode()
            if r.status == 200 and want in body:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s")


def wait_ready(procs: Procs, daemon: str, timeout: float = 300.0, count: int = 1) -> None:
    """Until the kvsched daemon at `daemon` has `count` ready instances."""
    from kvsched.client import Client, KvschedClientError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        with contextlib.suppress(KvschedClientError), Client(daemon, timeout=2) as c:
            if sum(1 for i in c.status().instances if i.ready) >= count:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{count} instance(s) not ready on {daemon} in {timeout:.0f} s")


@contextlib.contextmanager
def profiling(procs: Procs, logs: Path) -> Iterator[None]:
    """py-spy record (raw collapsed stacks, all threads, idle excluded) of every process."""
    spies = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--pid",
                str(p.pid),
                "--format",
                "raw",
                "--rate",
                "200",
                "--output",
                str(logs / f"{name}.pyspy"),
                "--nonblocking",
                "--subprocesses",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, p in procs.procs
    ]
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)


def summarize(path: Path, top: int = 12) -> str:
    """The functions with the most own samples, and each one's share, from py-spy raw output."""
    own: dict[str, int] = {}
    total = 0
    if not path.exists():
        return "(no profile)"
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        own[leaf] = own.get(leaf, 0) + int(count)
        total += int(count)
    rows = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return (
        "\n".join(f"{100 * n / total:5.1f} %  {leaf}" for leaf, n in rows) + f"\n({total} samples)"
    )
