"""LoRA adapters in a cluster: peers publish no adapters, so a LoRA request stays on the
daemon whose own workers announced its adapter (never forwarded to a peer's instance, which
might not have it), and a daemon whose workers did not announce it answers NOT_FOUND naming
it. Real nats-server, two daemons, one sim worker each (the same model; only d0's worker has
the adapter)."""

from __future__ import annotations

import pytest

from kvsched.client import Client, NotFound
from kvsched.cluster.natsd import NatsServer
from tests.integration.harness import start_daemon, start_worker, wait_ready


def test_a_lora_request_stays_where_its_adapter_is(nats_server: NatsServer) -> None:
    procs = []
    try:
        d0, a0 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cl-d0")
        d1, a1 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cl-d1")
        procs += [d0, d1]
        lora = ("--lora-modules", "sql=/adapters/sql", "--max-loras", "1")
        procs.insert(0, start_worker(a0, "cl-a", "--served-model-name", "m", *lora))
        procs.insert(0, start_worker(a1, "cl-b", "--zero-cost", "--served-model-name", "m"))
        wait_ready(a0, ["cl-a"])
        wait_ready(a1, ["cl-b"])
        with Client(a0, timeout=30) as c:
            before = c.status().cluster.num_forwarded
            for i in range(6):  # (cl-b is idle and zero-cost: by load alone it would win)
                s = c.generate([5 + i, 6, 7], max_tokens=3, lora_name="sql")
                assert s.instance == "cl-a" and len(s.tokens()) == 3
            assert c.status().cluster.num_forwarded == before, "forwarded to a peer"
        with Client(a1, timeout=30) as c, pytest.raises(NotFound) as e:
            c.generate([1, 2, 3], max_tokens=2, model="sql")
        assert "'sql'" in e.value.message
    finally:
        for p in procs:
            p.stop()
