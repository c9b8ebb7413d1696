"""Prefill/decode across two daemons of a cluster (issue 36): daemon A owns only a prefill
instance, daemon B only a decode instance; requests sent to A are prefilled on A's worker, the
prompt's full blocks go to the shared storage tier (a real Mooncake Store), and A hands each
request to B's decode instance with the token it made (the cluster's forward: the client keeps
its one stream to A, which relays B's tokens). Real processes on loopback: nats-server, two
`kvsched serve`, two `kvsched worker --executor model` whose tokens depend on the KV they read,
checked against `generate_reference`. With the store's master down the writes fail and B
recomputes the prompt: tokens still equal, both pools free, one Finished each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvsched.cluster.natsd import NatsServer
from kvsched.storage.server import MooncakeServer
from kvsched.v1 import request_service_pb2_grpc
from tests.e2e.harness import generate_request
from tests.e2e.test_model_worker import assert_matches_reference, collect, varied_requests
from tests.integration.harness import (
    Proc,
    start_daemon,
    start_worker,
    status,
    wait_hands_off,
    wait_pool_free,
)
from tests.integration.harness import wait_ready as wait_instances
from tests.storage.conftest import fresh_mooncake  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

A_TOML = """
[engine.scheduler]
max_num_batched_tokens = 48

[instances.p]
role = "prefill"

[instances.p.cache]
pd_transfer = "storage"
"""
B_TOML = """
[engine.scheduler]
max_num_batched_tokens = 48

[instances.d]
role = "decode"
"""
MODEL_WORKER = ("--executor", "model", "--backend", "numpy", "--num-blocks", "128")
MODEL_WORKER += ("--block-size", "8", "--num-slots", "8")


def _daemon(nats: str, store: str, name: str, toml: str, tmp: Path) -> tuple[Proc, str]:
    path = tmp / f"{name}.toml"
    path.write_text(toml)
    args = ("--cluster", nats, "--daemon-id", name, "--storage", store, "--config", str(path))
    return start_daemon(*args)


def _knows(address: str, instance: str, owner: str, timeout: float = 30.0) -> None:
    """Until the daemon at `address` knows `instance`'s load and that `owner` (a member)
    holds its lease: it may then hand requests to it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = status(address).cluster
        members = {m.daemon_id for m in c.daemons}
        if owner in members and any(
            i.instance_id == instance and i.load_known and i.owner_daemon_id == owner
            for i in c.instances
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"{address} does not know instance {instance} of {owner}")


def _run(nats: str, store: MooncakeServer, tmp: Path, kill_master: bool) -> tuple[Any, ...]:
    procs: list[Proc] = []
    try:
        da, a = _daemon(nats, store.url, "pda", A_TOML, tmp)
        procs.append(da)
        db, b = _daemon(nats, store.url, "pdb", B_TOML, tmp)
        procs.append(db)
        procs.append(start_worker(a, "p", *MODEL_WORKER))
        procs.append(start_worker(b, "d", *MODEL_WORKER))
        wait_instances(a, ["p"])
        wait_instances(b, ["d"])
        _knows(a, "d", "pdb")
        wait_hands_off(a)
        if kill_master:
            store.kill_master()
        specs = varied_requests(5, seed=36 + kill_master, prefix=f"x{int(kill_master)}-")
        with grpc.insecure_channel(a) as channel:
            stub = request_service_pb2_grpc.RequestServiceStub(channel)
            calls = [stub.Generate(generate_request(*s), timeout=60) for s in specs]
            results = [collect(s, call) for s, call in zip(specs, calls, strict=True)]
        st_a, st_b = wait_pool_free(a), wait_pool_free(b)  # every block of both daemons free
        return results, specs, st_a, st_b
    finally:
        for p in reversed(procs):
            p.stop()


def test_prefill_on_one_daemon_decode_on_another_through_the_store(
    nats_server: NatsServer,
    fresh_mooncake: MooncakeServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    results, specs, st_a, st_b = _run(nats_server.url, fresh_mooncake, tmp_path, False)
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"p"}
    p, d = st_a.instances[0], st_b.instances[0]
    assert st_a.cluster.num_forwarded >= len(specs)  # each handed to B's decode instance
    # B fetched every full prompt block A wrote, and computed only the rest.
    want = sum(len(prompt) // 8 for _, prompt, _ in specs)
    assert p.num_storage_writes >= want and p.num_storage_failures == 0
    assert d.prefix_cache_storage_hit_tokens == want * 8, d
    assert d.num_storage_fetches == want and d.num_storage_failures == 0


def test_store_down_the_peer_recomputes_the_prompt(
    nats_server: NatsServer,
    fresh_mooncake: MooncakeServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    try:
        results, _, st_a, st_b = _run(nats_server.url, fresh_mooncake, tmp_path, True)
    finally:
        fresh_mooncake.start_master()
    assert_matches_reference(results)
    assert {r.instance for r in results} == {"p"}
    p, d = st_a.instances[0], st_b.instances[0]
    assert p.num_storage_failures > 0  # its writes failed: nothing stored
    assert d.num_storage_fetches == 0 and d.prefix_cache_storage_hit_tokens == 0
