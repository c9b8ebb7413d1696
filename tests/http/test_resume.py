"""A front end whose connection to the daemon breaks mid-stream resumes the request through
kvsched's Resume (kvsched.client.resumable) on its next --server address: the HTTP client sees
one unbroken stream whose text is exactly the sim's tokens decoded, none lost or repeated.

The two --server addresses are two TCP proxies in front of the same daemon, so the test can cut
every connection between the front end and the daemon while both stay up."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tests.http.harness import MODEL, VOCAB, scrape, start_http, text_of, wait_ready
from tests.http.test_api import sim_tokens
from tests.integration.harness import start_daemon, start_worker


class Proxy:
    """A loopback TCP proxy to `target`; `cut()` closes every connection it carries (new ones
    are still accepted)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            with self.lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(conns)

    def close(self) -> None:
        self.sock.close()
        self.cut()


def test_a_broken_daemon_stream_is_resumed_without_a_gap(model_dir: Path) -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "i0", "--vocab-size", str(VOCAB))
    proxies = [Proxy(address), Proxy(address)]
    http = None
    try:
        wait_ready(address)
        http, url = start_http(model_dir, ",".join(p.address for p in proxies))
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        n_prompt = len(tok("Resume me").input_ids)
        body = {
            "model": MODEL,
            "prompt": "Resume me",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
            "request_id": "resume-1",
        }
        pieces: list[str] = []
        cut = 0
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                if len(pieces) == 5:  # mid-stream: every front end <-> daemon link broken
                    cut = sum(p.cut() for p in proxies)
        assert cut > 0
        want = text_of(tok, sim_tokens("resume-1", n_prompt, 1500))
        assert "".join(pieces) == want
        assert scrape(url + "/metrics", "kvsched_http_resumes_total") >= 1
    finally:
        for p in proxies:
            p.close()
        for proc in (http, worker, daemon):
            if proc is not None:
                proc.stop()
