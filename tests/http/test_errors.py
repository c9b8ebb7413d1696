"""Each error status of `kvsched http` provoked for real: 401 (a daemon with an auth file; the
caller's bearer token is passed through, also to the abort a stop string triggers), 429 (the
daemon's queue is full: RESOURCE_EXHAUSTED), 503 (the daemon is gone); and failover: with a
dead address among --server, every request is served through the live one."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.http.harness import MODEL, VOCAB, stack, start_http
from tests.integration.harness import start_daemon, start_worker, status, wait_ready
from tests.integration.test_auth import TOKENS, write_auth_file
from tests.integration.test_overload import config

LONG = 100_000


def _error(resp: httpx.Response, status_code: int) -> dict[str, Any]:
    assert resp.status_code == status_code, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def test_bearer_tokens_pass_through_to_the_daemons_auth(model_dir: Path, tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path)
    with stack(
        model_dir,
        daemon_args=("--auth-file", auth),
        worker_args=("--token", TOKENS["worker"]),
        admin_token=TOKENS["admin"],
    ) as live:
        url = live.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        err = _error(httpx.post(url, json=body, timeout=30), 401)
        assert err["type"] == "authentication_error"
        _error(
            httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30), 401
        )
        err = _error(httpx.post(url, json=body, headers={"Authorization": "Basic eA=="}), 401)
        assert "Bearer" in err["message"]
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model=MODEL, prompt="Hello", max_tokens=4
            )
        good = OpenAI(base_url=live.url + "/v1", api_key=TOKENS["client"], max_retries=0)
        out = good.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        # A stop string ends the request with the caller's token (an abort without it
        # would be refused, and the request would run to the end of the context).
        stopped = live.finished("stop")
        text = "".join(
            c.choices[0].text
            for c in good.completions.create(
                model=MODEL,
                prompt="Hello",
                max_tokens=LONG,
                stop=["e", "a", "o", " "],
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert not any(ch in text for ch in "eao ")
        assert live.wait_finished("stop", stopped + 1) == stopped + 1


def test_a_full_queue_is_429(model_dir: Path) -> None:
    cfg = config("[engine.scheduler]\nmax_waiting = 1\n")
    with stack(
        model_dir,
        daemon_args=("--config", cfg),
        worker_args=("--num-slots", "1", "--speed", "5"),
    ) as live:
        url = live.url + "/v1/completions"
        hog = {"model": MODEL, "prompt": "hog", "max_tokens": LONG, "ignore_eos": True}
        queued: list[httpx.Response] = []
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url, json={**hog, "stream": True}),
        ):
            # The hog holds the only slot; the next request waits in the queue (max 1) ...
            waiter = threading.Thread(
                target=lambda: queued.append(
                    httpx.post(
                        url, json={"model": MODEL, "prompt": "w", "max_tokens": 3}, timeout=60
                    )
                )
            )
            waiter.start()
            _wait(lambda: status(live.address).instances[0].num_waiting == 1)
            # ... and the one after it is shed.
            err = _error(httpx.post(url, json={**hog, "max_tokens": 3}, timeout=30), 429)
            assert err["type"] == "rate_limit_error"
            assert err["message"].startswith("kvsched:")
        waiter.join(60)  # the hog's stream closed: aborted; the waiter ran
        assert queued and queued[0].status_code == 200


def test_daemon_gone_is_503(model_dir: Path) -> None:
    with stack(model_dir, http_args=("--retry-for-s", "1")) as live:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).status_code == 200
        live.daemon.stop()
        err = _error(httpx.post(live.url + "/v1/completions", json=body, timeout=30), 503)
        assert err["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError):
            OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="Hello", max_tokens=4
            )


def test_a_dead_server_address_fails_over_to_the_live_one(model_dir: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    daemon, address = start_daemon()
    worker = start_worker(address, "i0", "--vocab-size", str(VOCAB))
    http = None
    try:
        wait_ready(address, ["i0"], timeout=60)
        http, url = start_http(model_dir, f"{dead},{address}")
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(4):  # the front end takes the two addresses in turn
            out = client.completions.create(model=MODEL, prompt=f"Hello {i}", max_tokens=5)
            assert out.choices[0].finish_reason == "length"
            assert out.usage is not None and out.usage.completion_tokens == 5
    finally:
        for p in (http, worker, daemon):
            if p is not None:
                p.stop()


def _wait(cond: Any, timeout: float = 15.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
