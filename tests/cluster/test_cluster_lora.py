"""LoRA adapters across a cluster: each daemon publishes its instances' adapters (their names,
max_loras and the adapters running or queued there) with their info, so any daemon knows an
adapter only a peer's workers announced (ListModels and `kvsched http`'s /v1/models list it
with its base; a request naming it is forwarded to the peer's instance, never refused), and a
LoRA request is routed cluster-wide by adapter affinity (llm-d's order: the adapter loaded >
a free adapter slot > neither). Real nats-server, daemons and sim workers (`--lora-modules`)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from kvsched.client import Client, NotFound
from kvsched.cluster.natsd import NatsServer
from tests.http.harness import VOCAB, make_model_dir, start_http
from tests.integration.harness import Proc, start_daemon, start_worker, status, wait_ready


def wait_known(address: str, instances: list[str], running: dict[str, int] | None = None) -> None:
    """Wait (10 s at most) until the daemon at `address` has a published load of each instance,
    and at least `running[i]` requests running or queued on instance i in it (the load and the
    adapters in use ride in the same publication)."""
    want = running or {}
    deadline = time.monotonic() + 10
    while True:
        seen = {i.instance_id: i for i in status(address).cluster.instances if i.load_known}
        if all(
            i in seen and seen[i].num_running + seen[i].num_waiting >= want.get(i, 0)
            for i in instances
        ):
            return
        assert time.monotonic() < deadline, f"{address}: {instances} {want} not published"
        time.sleep(0.05)


def test_a_peers_adapter_is_listed_and_its_requests_forwarded(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    procs: list[Proc] = []
    try:
        d0, a0 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cl-d0")
        d1, a1 = start_daemon("--cluster", nats_server.url, "--daemon-id", "cl-d1")
        procs += [d0, d1]
        vocab = ("--served-model-name", "tiny", "--vocab-size", str(VOCAB))
        lora = ("--lora-modules", "sql=/adapters/sql", "--max-loras", "1")
        procs.insert(0, start_worker(a0, "cl-a", *vocab, *lora))
        procs.insert(0, start_worker(a1, "cl-b", "--zero-cost", *vocab))
        wait_ready(a0, ["cl-a"])
        wait_ready(a1, ["cl-b"])
        wait_known(a0, ["cl-a", "cl-b"])
        wait_known(a1, ["cl-a", "cl-b"])
        with Client(a1, timeout=30) as c:
            deadline = time.monotonic() + 10  # (once d1's membership and lease views agree)
            while not (adapters := [m for m in c.list_models() if m.parent]):
                assert time.monotonic() < deadline, "d1 never listed its peer's adapter"
                time.sleep(0.05)
            assert [(m.name, m.parent, m.root) for m in adapters] == [
                ("sql", "tiny", "/adapters/sql")
            ]
            before = c.status().cluster.num_forwarded
            for i in range(4):  # (cl-b is idle, local and zero-cost: by load alone it would win)
                how = {"model": "sql"} if i % 2 else {"lora_name": "sql"}
                s = c.generate([5 + i, 6, 7], max_tokens=3, **how)  # type: ignore[arg-type]
                assert len(s.tokens()) == 3 and s.finished is not None
            assert c.status().cluster.num_forwarded == before + 4, "not forwarded to cl-a"
            with pytest.raises(NotFound) as e:
                c.generate([1, 2, 3], max_tokens=2, model="poetry")
            assert "'poetry'" in e.value.message
        with Client(a0, timeout=30) as c:
            before = c.status().cluster.num_forwarded
            for i in range(3):  # cl-b lacks the adapter: never forwarded to it
                s = c.generate([9 + i, 6, 7], max_tokens=3, lora_name="sql")
                assert s.instance == "cl-a" and len(s.tokens()) == 3
            assert c.status().cluster.num_forwarded == before, "forwarded to a peer"
        http, url = start_http(make_model_dir(tmp_path / "tok"), a1)
        procs.insert(0, http)
        data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("sql", "tiny")]
        assert data[1]["root"] == "/adapters/sql" and data[1]["ready_instances"] == 1
        body = {"model": "sql", "prompt": "Hi", "max_tokens": 3}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=30)  # forwarded to cl-a
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "sql" and resp.json()["usage"]["completion_tokens"] == 3
        assert status(a1).cluster.num_forwarded == before + 5
    finally:
        for p in procs:
            p.stop()


def test_lora_requests_follow_adapter_affinity_across_daemons(nats_server: NatsServer) -> None:
    """Two daemons, one instance each, both able to load adapters x and y with one adapter slot
    (max_loras 1). A long request of x goes somewhere (Ix); two more of x, sent to each daemon,
    follow it there though Ix is the busier (the adapter loaded wins over load); a long
    request of y must take the other instance, the one with a free slot (Iy != Ix); then every
    request of x sent to either daemon goes to Ix and every one of y to Iy (forwarded when that
    instance is the peer's): loaded before free slot before neither."""
    procs: list[Proc] = []
    holders = []
    try:
        d0, a0 = start_daemon("--cluster", nats_server.url, "--daemon-id", "af-d0")
        d1, a1 = start_daemon("--cluster", nats_server.url, "--daemon-id", "af-d1")
        procs += [d0, d1]
        lora = ("--lora-modules", "x=/adapters/x", "y=/adapters/y", "--max-loras", "1")
        slow = ("--served-model-name", "m", "--speed", "0.05", *lora)
        procs.insert(0, start_worker(a0, "af-a", *slow))
        procs.insert(0, start_worker(a1, "af-b", *slow))
        wait_ready(a0, ["af-a"])
        wait_ready(a1, ["af-b"])
        both = ["af-a", "af-b"]
        for a in (a0, a1):
            wait_known(a, both)
        c0, c1 = Client(a0, timeout=120), Client(a1, timeout=120)
        holders.append(c0.generate([1, 2, 3, 4], max_tokens=2000, lora_name="x"))
        ix = holders[0].instance
        assert ix in both
        for a in (a0, a1):
            wait_known(a, both, {ix: 1})
        for k, c in enumerate((c1, c0)):  # x is loaded on ix: more of x go there, busy as it is
            holders.append(c.generate([1, 2, 3, 5 + k], max_tokens=2000, lora_name="x"))
            assert holders[-1].instance == ix
        holders.append(c1.generate([4, 3, 2, 1], max_tokens=2000, lora_name="y"))
        iy = holders[-1].instance
        assert iy in both and iy != ix, "y did not take the instance with a free adapter slot"
        for a in (a0, a1):
            wait_known(a, both, {ix: 3, iy: 1})
        forwarded = [c.status().cluster.num_forwarded for c in (c0, c1)]
        for i in range(3):
            for c in (c0, c1):
                for name, want in (("x", ix), ("y", iy)):
                    with c.generate([7, i, 9], max_tokens=40, lora_name=name) as s:
                        assert s.instance == want, f"{name} went to {s.instance}, not {want}"
        after = [c.status().cluster.num_forwarded for c in (c0, c1)]
        assert after[0] - forwarded[0] == 3 and after[1] - forwarded[1] == 3, (forwarded, after)
        for h in holders:
            h.cancel()
        c0.close()
        c1.close()
    finally:
        for h in holders:
            h.cancel()
        for p in procs:
            p.stop()
