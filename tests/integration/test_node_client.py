"""The Node.js example client against a live daemon: tokens streamed, errors reported, and its
OpenTelemetry client span the parent of the daemon's request span in one trace."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

import pytest

from tests.integration.clients import SIM
from tests.integration.harness import REPO, start_daemon, start_worker, wait_ready
from tests.server.telemetry_harness import OtlpReceiver, attributes

NODE_DIR = REPO / "examples" / "node"


@pytest.fixture(autouse=True)
def _node_installed() -> None:
    # CI installs Node.js and `make test` runs npm install: a missing one is a broken setup.
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH: install Node.js 20 (CI's .ci/run does)")
    for pkg in ("@grpc/grpc-js", "@opentelemetry/exporter-trace-otlp-grpc"):
        if not (NODE_DIR / "node_modules" / pkg).exists():
            pytest.fail(f"examples/node lacks {pkg}: `make test` installs them (npm install)")


def node(
    address: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", "generate.js", "--server", address, *args],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_node_client_streams_tokens() -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "i0", "--zero-cost")
    try:
        wait_ready(address, ["i0"])
        res = node(address, "--max-tokens", "5", "11", "12", "13", "14")
        assert res.returncode == 0, res.stderr
        lines = res.stdout.strip().splitlines()
        assert lines[0].startswith("queued ")
        req_id = lines[0].split()[1]
        tokens = [int(t) for line in lines if line.startswith("tokens ") for t in line.split()[1:]]
        assert tokens == [SIM.token_at(req_id, 4 + i) for i in range(5)]
        assert lines[-1].startswith("finished FINISH_REASON_LENGTH prompt=4 output=5")
        bad = node(address, "--max-tokens", "0", "1")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        worker.stop()
        daemon.stop()


def _wait_for_spans(receiver: OtlpReceiver, want: int, timeout: float = 20.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.spans()
        if len(spans) >= want:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"{len(receiver.spans())} spans at the receiver, wanted {want}")


def test_node_span_is_the_parent_of_the_daemon_request_span() -> None:
    receiver = OtlpReceiver()
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon rather than in 5 s
    }
    daemon, address = start_daemon("--tracing", "otlp", env=otel)
    worker = start_worker(address, "i0", "--zero-cost")
    try:
        wait_ready(address, ["i0"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        res = node(address, "--max-tokens", "3", "21", "22", "23", env={**env, **otel})
        assert res.returncode == 0, res.stderr
        req_id = res.stdout.splitlines()[0].split()[1]
        trace_id, span_id = res.stderr.split("trace ", 1)[1].split()[0::2][:2]
        spans = _wait_for_spans(receiver, 2)
    finally:
        worker.stop()
        daemon.stop()
        receiver.stop()
    by_service: dict[str, list[Any]] = {}
    for resource, span in spans:
        by_service.setdefault(resource["service.name"], []).append(span)
    (client_span,) = by_service["kvsched-node-example"]
    (server_span,) = by_service["kvsched"]
    # The ids the Node process printed are those of the span it exported.
    assert client_span.trace_id.hex() == trace_id and client_span.span_id.hex() == span_id
    assert client_span.name == "kvsched.v1.RequestService/Generate"
    assert attributes(client_span.attributes)["kvsched.request_id"] == req_id
    # kvsched's request span: same trace, the Node span its parent.
    assert server_span.trace_id == client_span.trace_id
    assert server_span.parent_span_id == client_span.span_id
    assert server_span.span_id != client_span.span_id
