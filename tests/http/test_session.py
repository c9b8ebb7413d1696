"""`kvsched http` sends its requests over the daemon's Session stream (one per daemon address and
bearer token) and demultiplexes the batched token deltas to each HTTP response: concurrent
requests share one stream (the daemon's per-session limit shows it), each gets exactly its own
tokens, a client that disconnects gets only its own request aborted (an abort on the session),
and a session that breaks under a front end with one --server address ends its accepted
requests in an error the client sees (the daemon aborts them), after which a new session
serves the next requests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from tests.http.harness import MODEL, VOCAB, Stack, stack, start_http, text_of, wait_ready
from tests.http.test_api import sim_tokens
from tests.http.test_resume import Proxy
from tests.integration.harness import start_daemon, start_worker, status
from tests.integration.test_overload import config

LONG = 100_000


def _sse_lines(resp: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """The events of a streamed response: parsed JSON, or "[DONE]"."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def _open_requests(address: str) -> int:
    return sum(i.num_running + i.num_waiting for i in status(address).instances)


def _wait(cond: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_concurrent_requests_share_one_session_and_a_disconnect_aborts_only_its_own(
    model_dir: Path,
) -> None:
    # A daemon whose Session streams hold at most 2 open requests: a third concurrent request
    # through the front end is refused by that limit (RESOURCE_EXHAUSTED -> 429), which only
    # a shared stream reaches (Generate calls have no such limit).
    cfg = config("max_session_requests = 2\n")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with stack(model_dir, daemon_args=("--config", cfg), http_args=("--sessions", "1")) as live:
        url = live.url + "/v1/completions"
        hog = {"model": MODEL, "prompt": "hog", "max_tokens": LONG, "ignore_eos": True}
        aborted = live.finished("abort")
        with (
            httpx.Client(timeout=60) as h1,
            h1.stream("POST", url, json={**hog, "stream": True, "request_id": "hog-1"}) as r1,
        ):
            assert r1.status_code == 200
            events1 = _sse_lines(r1)
            assert isinstance(next(events1), dict)
            # The second request (not streamed) runs to its end beside the hog, on the same
            # session, with exactly its own tokens.
            n_prompt = len(tok("second").input_ids)
            done: list[httpx.Response] = []
            body = {"model": MODEL, "prompt": "second", "max_tokens": 40, "ignore_eos": True}
            second = threading.Thread(
                target=lambda: done.append(
                    httpx.post(url, json={**body, "request_id": "second"}, timeout=60)
                )
            )
            with (
                httpx.Client(timeout=60) as h2,
                h2.stream("POST", url, json={**hog, "stream": True, "request_id": "hog-2"}) as r2,
            ):
                assert r2.status_code == 200
                events2 = _sse_lines(r2)  # kept: a generator collected closes the response
                assert isinstance(next(events2), dict)
                err = httpx.post(url, json={**hog, "max_tokens": 3}, timeout=30)
                assert err.status_code == 429, err.text
                assert "max_session_requests" in err.json()["error"]["message"]
            # hog-2's client went: its request (only it) is aborted, freeing a place.
            assert live.wait_finished("abort", aborted + 1) == aborted + 1
            second.start()
            second.join(60)
            assert done and done[0].status_code == 200, done and done[0].text
            out = done[0].json()["choices"][0]
            assert out["text"] == text_of(tok, sim_tokens("second", n_prompt, 40))
            assert out["finish_reason"] == "length"
            assert _open_requests(live.address) == 1  # hog-1 still runs
            pieces = [e for _, e in zip(range(20), events1, strict=False)]
            assert all(isinstance(e, dict) for e in pieces)
        assert live.wait_finished("abort", aborted + 2) == aborted + 2
        _wait(lambda: _open_requests(live.address) == 0)


def test_a_broken_session_with_one_server_ends_its_requests_in_error(
    model_dir: Path,
) -> None:
    daemon, address = start_daemon("--metrics-listen", "127.0.0.1:0")
    metrics = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
    worker = start_worker(address, "i0", "--vocab-size", str(VOCAB))
    proxy = Proxy(address)
    http = None
    try:
        wait_ready(address)
        http, url = start_http(model_dir, proxy.address)
        live = Stack(daemon, address, f"http://{metrics}/metrics", http, url)
        aborted = live.finished("abort")
        body = {"model": MODEL, "prompt": "cut", "max_tokens": LONG, "ignore_eos": True}
        events: list[dict[str, Any] | str] = []
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r,
        ):
            assert r.status_code == 200
            for e in _sse_lines(r):
                events.append(e)
                if len(events) == 3:
                    assert proxy.cut() > 0  # the front end's session to the daemon breaks
        # The stream ends with an error event, then [DONE]; the daemon aborted the request
        # (its stream dropped; a front end with one address sends non-detachable requests).
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert isinstance(last, dict) and "error" in last, events[-3:]
        assert last["error"]["message"].startswith("kvsched:")
        assert live.wait_finished("abort", aborted + 1) == aborted + 1
        _wait(lambda: _open_requests(address) == 0)
        # A new session serves the next request.
        ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 5}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
    finally:
        proxy.close()
        for p in (http, worker, daemon):
            if p is not None:
                p.stop()
