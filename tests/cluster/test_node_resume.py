"""The Node example's resuming front end (examples/node/resume.js) across a daemon killed with
SIGKILL and restarted under the same id: every token printed once, equal to an uninterrupted
run."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import Daemon, sim_expected, start_sim_worker
from tests.integration.harness import wait_ready

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"


def test_node_front_end_resumes_after_kill9(nats_server: NatsServer) -> None:
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH: install Node.js 20 (CI's .ci/run does)")
    if not (NODE_DIR / "node_modules" / "@grpc").exists():
        pytest.fail("examples/node lacks its packages: `make test` installs them (npm install)")
    daemon = Daemon(nats_server.url, "node-d").start()
    worker = start_sim_worker(daemon.address, "i0", "--speed", "0.05")
    prompt = ["7", "8", "9"]
    node = subprocess.Popen(
        ["node", "resume.js", "--server", daemon.address, "--max-tokens", "120"]
        + ["--id", "node-resume", "--retry-s", "60", *prompt],
        cwd=NODE_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_ready(daemon.address, ["i0"])
        assert node.stdout is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the first tokens, then the kill
            line = node.stdout.readline()
            lines.append(line.strip())
            if line.startswith("tokens"):
                break
        daemon.kill9()
        daemon.start()
        out, _ = node.communicate(timeout=90)
        lines += out.splitlines()
        assert node.returncode == 0, "\n".join(lines)
        assert any(x.startswith("resumed after") for x in lines), lines
        toks = [int(t) for x in lines if x.startswith("tokens") for t in x.split()[1:]]
        assert toks == sim_expected("node-resume", 3, 120)
        assert lines[-1].startswith("finished FINISH_REASON_LENGTH output=120"), lines[-3:]
    finally:
        if node.poll() is None:
            node.kill()
        worker.stop()
        daemon.stop()
