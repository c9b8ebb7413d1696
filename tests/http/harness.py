"""A real stack on loopback for the HTTP front end's tests: `kvsched serve`, `kvsched worker
--executor sim --vocab-size 512` (token ids the tiny tokenizer decodes) and `kvsched http`,
each a child process started as a user would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvsched.client import Client
from tests.integration.harness import Proc, start_daemon, start_worker

MODEL = "tiny"
VOCAB = 512


def make_model_dir(path: Path) -> Path:
    from kvsched.tinymodel.tokenizer import make_tokenizer

    return make_tokenizer(path, vocab_size=VOCAB)


def text_of(tok: Any, ids: list[int]) -> str:
    """The text vLLM's server answers for output `ids` (skip_special_tokens): the decoding of
    the longest prefix of them whose decoding does not end inside a character (U+FFFD): the
    bytes of an incomplete last character, and what came with them, are dropped."""
    for k in range(len(ids), -1, -1):
        text: str = tok.decode(ids[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text
    return ""


def start_http(model_dir: Path, servers: str, *args: str) -> tuple[Proc, str]:
    proc = Proc(
        [
            "http",
            "--listen",
            "127.0.0.1:0",
            "--server",
            servers,
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL,
            "--log-level",
            "warning",
            *args,
        ],
        name="http",
    )
    m = proc.wait_for(r"kvsched http listening on (\S+:\d+)", timeout=60)
    return proc, f"http://{m.group(1)}"


@contextmanager
def stack(
    model_dir: Path,
    daemon_args: tuple[str, ...] = (),
    worker_args: tuple[str, ...] = (),
    http_args: tuple[str, ...] = (),
    admin_token: str = "",
) -> Iterator[Stack]:
    """Daemon (with its metrics endpoint), one sim worker, the front end; all stopped after."""
    daemon, address = start_daemon("--metrics-listen", "127.0.0.1:0", *daemon_args)
    procs = [daemon]
    try:
        metrics = daemon.wait_for(r"kvsched metrics on (\S+:\d+)").group(1)
        procs.append(start_worker(address, "i0", "--vocab-size", str(VOCAB), *worker_args))
        wait_ready(address, admin_token)
        http, url = start_http(model_dir, address, *http_args)
        procs.append(http)
        s = Stack(daemon, address, f"http://{metrics}/metrics", http, url)
        s.worker = procs[1]
        yield s
    finally:
        for p in reversed(procs):
            p.stop()


class Stack:
    def __init__(self, daemon: Proc, address: str, metrics_url: str, http: Proc, url: str) -> None:
        self.daemon = daemon
        self.address = address
        self.metrics_url = metrics_url
        self.http = http
        self.url = url
        self.worker: Proc | None = None

    def finished(self, reason: str) -> float:
        """The daemon's count of requests finished with `reason` (kvsched_request_success)."""
        return scrape(self.metrics_url, "kvsched_request_success_total", finished_reason=reason)

    def wait_finished(self, reason: str, at_least: float, timeout: float = 15.0) -> float:
        deadline = time.monotonic() + timeout
        while (n := self.finished(reason)) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return n


def scrape(url: str, sample: str, **labels: str) -> float:
    """The sum of a sample's values whose labels include `labels` (0 when absent)."""
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_ready(address: str, admin_token: str = "", timeout: float = 60.0) -> None:
    """Wait until the daemon's instance i0 is ready (status with the admin token, if any)."""
    deadline = time.monotonic() + timeout
    with Client(address, token=admin_token, timeout=5) as c:
        while not any(i.instance_id == "i0" and i.ready for i in c.status().instances):
            assert time.monotonic() < deadline, f"i0 not ready: {c.status()}"
            time.sleep(0.05)
