"""The Node.js example client against a live daemon."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.integration.clients import SIM
from tests.integration.harness import REPO, start_daemon, start_worker, wait_ready

NODE_DIR = REPO / "examples" / "node"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed on this machine")
def test_node_client_streams_tokens() -> None:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("examples/node has no node_modules: `make test` installs them (npm install)")
    daemon, address = start_daemon()
    worker = start_worker(address, "i0", "--zero-cost")
    try:
        wait_ready(address, ["i0"])
        prompt = ["11", "12", "13", "14"]
        res = subprocess.run(
            ["node", "generate.js", "--server", address, "--max-tokens", "5", *prompt],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        lines = res.stdout.strip().splitlines()
        assert lines[0].startswith("queued ")
        req_id = lines[0].split()[1]
        tokens = [int(t) for line in lines if line.startswith("tokens ") for t in line.split()[1:]]
        assert tokens == [SIM.token_at(req_id, 4 + i) for i in range(5)]
        assert lines[-1].startswith("finished FINISH_REASON_LENGTH prompt=4 output=5")
        bad = subprocess.run(
            ["node", "generate.js", "--server", address, "--max-tokens", "0", "1"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        worker.stop()
        daemon.stop()
