"""A Generate whose caller gives up while the daemon waits for the journal's acknowledgement
(the daemon cut from NATS with its connection left open: bytes held, delivered at the heal)
leaves no accepted record that nobody runs: the journal write is not cancelled with the call,
so the record ends stored (and the request's end follows it) or refused and purged. Found by
the 30-minute nemesis run (docs/RELIABILITY.md): such records made every Resume answer
"belongs to daemon d1" for minutes."""

from __future__ import annotations

import time

import pytest

from bench.chaos.proxy import ProxySet
from kvsched.client import Client, KvschedClientError, NotFound
from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import Daemon, prompts, start_sim_worker
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a partition scenario: `make test-faults` (a CI step)


def test_a_generate_abandoned_during_a_nats_cut_leaves_no_orphan_record(
    nats_server: NatsServer,
) -> None:
    proxies = ProxySet()
    d0: Daemon | None = None
    worker: Proc | None = None
    try:
        nats_addr = proxies.add("nats-d0", f"127.0.0.1:{nats_server.port}")
        env = {"KVSCHED_JOURNAL_TIMEOUT_S": "4"}
        d0 = Daemon(f"nats://{nats_addr}", "jc-d0", env=env).start()
        worker = start_sim_worker(d0.address, "jc0", "--speed", "0.3")
        wait_ready(d0.address, ["jc0"], 60.0)
        prompt = prompts(1, seed=5)[0]
        with Client(d0.address) as client:
            proxies.cut(["nats-d0"])
            # The caller's deadline passes while the accepted record waits for its ack.
            with pytest.raises(KvschedClientError):
                stream = client.generate(prompt, max_tokens=8, request_id="jc-1", timeout=1.0)
                list(stream)
            time.sleep(0.5)
            proxies.heal(["nats-d0"])  # the held record reaches the journal now
            # The journal settles: a Resume is answered by the record's end (stored, then
            # finished: aborted with its caller or run to its end) or NOT_FOUND (refused and
            # purged); never, for long, "belongs to daemon jc-d0" from jc-d0 itself.
            deadline, last = time.monotonic() + 20.0, ""
            while True:
                try:
                    got = client.resume("jc-1", timeout=5.0)
                    list(got)
                    assert got.finished is not None
                    break
                except NotFound:
                    break
                except KvschedClientError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                assert time.monotonic() < deadline, f"the request's record never settled: {last}"
                time.sleep(0.5)
    finally:
        for p in (worker, d0):
            if p is not None:
                p.stop()
        proxies.close()
