"""The gateway and the daemon each restarted under the other: smg finds kvsched again (the
daemon restarted on its address, its worker reconnected, smg's health check sees it healthy)
and a new smg registers a running daemon; a daemon with auth takes the gateway's bearer token
(smg --api-key) and refuses a gateway without one."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from tests.gateway.harness import Smg, free_port, kvsched_and_smg
from tests.http.harness import MODEL, make_model_dir, wait_ready
from tests.integration.harness import Proc, start_daemon, start_worker

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def chat(url: str, token: str = "unused") -> str | None:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=10)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    return r.choices[0].finish_reason


def chat_within(url: str, seconds: float) -> str | None:
    """The first chat that succeeds within `seconds` (each failure retried at once)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return chat(url)
        except openai.APIError:
            if time.monotonic() > deadline:
                raise


def test_gateway_restart_registers_the_running_daemon(model_dir: Path) -> None:
    with kvsched_and_smg(model_dir) as f:
        assert chat(f.smg.url) in ("length", "stop")
        f.smg.stop()
        again = Smg([f.address])
        f.procs.append(again)
        again.wait_model()
        assert chat(again.url) in ("length", "stop")


def test_daemon_restart_is_found_again_by_the_gateway(model_dir: Path) -> None:
    port = free_port()
    args = ("--listen", f"127.0.0.1:{port}", "--tokenizer", str(model_dir))
    with kvsched_and_smg(model_dir, daemon_args=args) as f:
        assert chat(f.smg.url) in ("length", "stop")
        f.daemon.signal()
        assert f.daemon.wait() == 0
        daemon, _ = start_daemon(*args)
        f.procs.insert(0, daemon)  # stopped last
        wait_ready(f.address)  # its worker reconnected
        assert chat_within(f.smg.url, 30) in ("length", "stop")


def test_a_daemon_with_auth_serves_no_gateway_without_a_token(
    model_dir: Path, tmp_path: Path
) -> None:
    """smg 1.13.0 sends no bearer token on its gRPC calls (its --api-key guards its own HTTP
    API): a daemon with an auth file refuses it (HealthCheck UNAUTHENTICATED), so the gateway
    never lists the model. docs/GATEWAY.md: run such a daemon on a private address."""
    auth = tmp_path / "auth"
    auth.write_text("worker worker-secret-0123456789\nadmin admin-secret-0123456789\n")
    daemon, address = start_daemon("--auth-file", str(auth), "--tokenizer", str(model_dir))
    procs: list[Proc | Smg] = [daemon]
    try:
        procs.append(
            start_worker(
                address,
                "i0",
                "--vocab-size",
                "512",
                "--served-model-name",
                MODEL,
                "--token",
                "worker-secret-0123456789",
            )
        )
        wait_ready(address, "admin-secret-0123456789")
        gw = Smg([address], "--api-key", "gateway-secret-0123456789")
        procs.append(gw)
        with pytest.raises(AssertionError, match="never listed"):
            gw.wait_model(timeout=5)
        assert "UNAUTHENTICATED" in daemon.output() or "missing credentials" in "\n".join(gw.lines)
    finally:
        for p in reversed(procs):
            p.stop()
