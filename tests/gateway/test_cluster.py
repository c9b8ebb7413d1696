"""Two daemons of one cluster behind one smg: one of them has no worker of its own, yet the
gateway registers both (each answers for the cluster's model) and every request through
either succeeds (that daemon forwards it to its peer's instance). Real nats-server."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from kvsched.cluster.natsd import NatsServer
from tests.gateway.harness import Smg
from tests.http.harness import MODEL, VOCAB, make_model_dir, scrape
from tests.integration.harness import Proc, start_daemon, start_worker, status, wait_ready


@pytest.fixture(scope="module")
def nats_server() -> NatsServer:
    with NatsServer() as server:
        yield server


def test_two_daemons_of_a_cluster_behind_one_gateway(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    model_dir = make_model_dir(tmp_path / "tiny")
    procs: list[Proc | Smg] = []
    try:
        addrs: list[str] = []
        metrics: list[str] = []
        for d in range(2):
            proc, addr = start_daemon(
                "--cluster",
                nats_server.url,
                "--daemon-id",
                f"gw-d{d}",
                "--tokenizer",
                str(model_dir),
                "--metrics-listen",
                "127.0.0.1:0",
            )
            procs.append(proc)
            addrs.append(addr)
            metrics.append(proc.wait_for(r"kvsched metrics on (\S+:\d+)").group(1))
        procs.insert(
            0,
            start_worker(addrs[0], "gw0", "--vocab-size", str(VOCAB), "--served-model-name", MODEL),
        )
        wait_ready(addrs[0], ["gw0"])
        deadline = time.monotonic() + 30
        while not any(i.load_known for i in status(addrs[1]).cluster.instances):
            assert time.monotonic() < deadline, "d1 never learned of gw0"
            time.sleep(0.1)
        gateway = Smg(addrs, "--policy", "round_robin")
        procs.append(gateway)
        gateway.wait_model()
        deadline = time.monotonic() + 30
        while True:  # both registered (the second may come a moment after the first)
            workers = httpx.get(f"{gateway.url}/workers", timeout=5).json()
            urls = {w.get("url") for w in workers.get("workers", [])}
            if {f"grpc://{a}" for a in addrs} <= urls:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        for i in range(8):
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].finish_reason == "length"
        # Round robin: half came through d1, which has no instance: it forwarded them to gw0.
        assert not status(addrs[1]).instances
        served = [
            scrape(f"http://{m}/metrics", "kvsched_request_success_total", finished_reason="length")
            for m in metrics
        ]
        print("finished per daemon:", served)
        assert served[1] == 4
    finally:
        for p in reversed(procs):
            p.stop()
