"""`kvsched mooncake`: starts a store on the given loopback ports, prints its URL, serves puts
and gets through it, and stops cleanly on SIGTERM (exit 0)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time

from kvsched.storage import MooncakeStore
from kvsched.storage.server import free_port
from tests.storage.conftest import needs_mooncake


@needs_mooncake
def test_kvsched_mooncake_prints_a_working_url_and_stops_on_sigterm() -> None:
    port, meta = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvsched.cli",
            "mooncake",
            "--listen",
            f"127.0.0.1:{port}",
            "--metadata-port",
            str(meta),
            "--capacity",
            "64MB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the master and the holder listen
        m = re.search(r"store at (mooncake://\S+)", line)
        assert m, f"no URL in {line!r}"
        url = m.group(1)
        assert url == f"mooncake://127.0.0.1:{port}?metadata=127.0.0.1:{meta}"
        with MooncakeStore.connect(url) as store:
            store.put("cli/k", b"kv" * 1000)
            assert store.get("cli/k") == b"kv" * 1000
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    deadline = time.monotonic() + 5  # the master went with it: its port can be bound again
    while True:
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline, f"{port} still taken after kvsched mooncake ended"
            time.sleep(0.1)


def test_bad_capacity_is_one_line_and_status_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "mooncake", "--capacity", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "not a size" in out.stderr
