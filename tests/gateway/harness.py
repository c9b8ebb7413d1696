"""The real smg gateway (PyPI `smg`, the `gateway` extra) in front of real kvsched daemons on
loopback: `smg launch` started as a user would, with its HTTP and Prometheus ports on
127.0.0.1 and a 1 s health check (so a restarted daemon is seen again at once)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.http.harness import MODEL, VOCAB, scrape, wait_ready
from tests.integration.harness import Proc, child_env, start_daemon, start_worker


def smg_binary() -> str:
    """The `smg` console script beside this interpreter (the gateway extra), else on PATH."""
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    assert found, "smg is not installed: pip install -e '.[gateway]'"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Smg:
    """One `smg launch` process; its output lines are collected by a thread."""

    def __init__(self, workers: list[str], *args: str, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            smg_binary(),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--log-level",
            "warn",
            "--worker-urls",
            *(w if "://" in w else f"grpc://{w}" for w in workers),
            *args,
        ]
        env = child_env({"NO_COLOR": "1", "RUST_LOG_STYLE": "never"})
        self.popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.lines.append(raw.rstrip("\n"))
        self._q.put(None)

    def wait_model(self, model: str = MODEL, timeout: float = 60.0) -> None:
        """Wait until the gateway lists `model` (it registered a healthy kvsched)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, "smg exited:\n" + "\n".join(self.lines[-40:])
            try:
                got = httpx.get(f"{self.url}/v1/models", timeout=2).json()
                if any(m.get("id") == model for m in got.get("data", [])):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"smg never listed {model!r}:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        """SIGKILL (its graceful stop waits 5 s for load balancers to notice)."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


@contextmanager
def kvsched_and_smg(
    model_dir: Path,
    daemon_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    smg_args: tuple[str, ...] = (),
    admin_token: str = "",
) -> Iterator[Front]:
    """A daemon (metrics on, --tokenizer the model dir), one sim worker serving `tiny`, smg in
    front of the daemon; all stopped after."""
    daemon, address = start_daemon(
        "--metrics-listen", "127.0.0.1:0", "--tokenizer", str(model_dir), *daemon_args
    )
    procs: list[Proc | Smg] = [daemon]
    try:
        metrics = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
        worker = start_worker(
            address, "i0", "--vocab-size", str(VOCAB), "--served-model-name", MODEL, *worker_args
        )
        procs.append(worker)
        wait_ready(address, admin_token)
        smg = Smg([address], *smg_args)
        procs.append(smg)
        smg.wait_model()
        yield Front(daemon, address, f"http://{metrics}/metrics", worker, smg, procs)
    finally:
        for p in reversed(procs):
            p.stop()


class Front:
    def __init__(
        self,
        daemon: Proc,
        address: str,
        metrics_url: str,
        worker: Proc,
        smg: Smg,
        procs: list[Proc | Smg],
    ) -> None:
        self.procs = procs  # stopped at the end, last first: a test appends what it starts
        self.daemon = daemon
        self.address = address
        self.metrics_url = metrics_url
        self.worker = worker
        self.smg = smg

    def finished(self, reason: str) -> float:
        """The daemon's count of requests finished with `reason`."""
        return scrape(self.metrics_url, "kvsched_request_success_total", finished_reason=reason)
