"""NATS restarted under load: routing degrades to each daemon's own instances, nothing accepted
is lost, and the cluster heals (membership, leases, KV-event index) once NATS is back.

With the journal on (the default in a cluster) a request submitted while NATS is away is refused
(UNAVAILABLE naming the journal: durability first, nothing half-accepted); with `journal =
false` it is accepted and routed locally. Both are run."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time

import grpc
import pytest

from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from tests.cluster.conftest import start_cluster
from tests.integration.clients import Outcome, Spec, generate
from tests.integration.harness import status, wait_pool_free

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)


def _wait(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_nats_restart_under_load(journal: bool) -> None:
    store = tempfile.mkdtemp(prefix="kvsched-nats-restart-")
    nats = NatsServer(store_dir=store).start()
    cluster = None
    try:
        cluster = start_cluster(
            nats.url,
            "nr",
            2,
            1,
            worker_args=("--speed", "4"),
            daemon_env={"KVSCHED_JOURNAL": "true" if journal else "false"},
        )
        addrs = cluster.addresses
        rng = random.Random(3)
        prefixes = [[rng.randrange(3, 30000) for _ in range(128)] for _ in range(5)]
        specs = [
            Spec(f"nr-{i}", prefixes[i % 5] + [rng.randrange(3, 30000) for _ in range(9)], 6)
            for i in range(600)
        ]
        phase: dict[str, object] = {}

        def connected(addr: str) -> bool:
            return status(addr).cluster.connected

        def forwarded() -> int:
            return sum(status(a).cluster.num_forwarded for a in addrs)

        async def load() -> list[tuple[Spec, Outcome]]:
            channels = [grpc.aio.insecure_channel(a) for a in addrs]
            stubs = [request_service_pb2_grpc.RequestServiceStub(ch) for ch in channels]
            sem = asyncio.Semaphore(8)
            out: list[tuple[Spec, Outcome]] = []

            async def one(k: int, s: Spec) -> None:
                async with sem:
                    await asyncio.sleep(0.01)  # spread over the outage
                    out.append((s, await generate(stubs[k % 2], s.message(), timeout=60)))

            await asyncio.gather(*(one(k, s) for k, s in enumerate(specs)))
            for ch in channels:
                await ch.close()
            return out

        async def chaos() -> None:
            await asyncio.sleep(1.0)
            nats.stop()
            await asyncio.to_thread(
                _wait, lambda: not any(connected(a) for a in addrs), "daemons to see NATS gone"
            )
            phase["down_forwarded"] = await asyncio.to_thread(forwarded)
            await asyncio.sleep(1.5)  # load keeps coming: routed locally
            phase["still_down_forwarded"] = await asyncio.to_thread(forwarded)
            nats.start()

        async def both() -> list[tuple[Spec, Outcome]]:
            results, _ = await asyncio.gather(load(), chaos())
            return results

        results = asyncio.run(both())
        assert len(results) == len(specs)
        refused = 0
        for s, o in results:
            if journal and o.code == grpc.StatusCode.UNAVAILABLE:
                # Refused at submit while the journal could not store it: never accepted.
                assert "journal" in o.details and "nothing was accepted" in o.details, o.details
                assert o.tokens == [] and o.finished is None, s.req_id
                refused += 1
                continue
            assert o.code is None, (s.req_id, o.code, o.details)
            assert o.finished is not None and o.finished.reason == common_pb2.FINISH_REASON_LENGTH
            assert o.tokens == s.expected, s.req_id
        assert refused < len(specs), "requests before and after the outage are accepted"
        if not journal:
            assert refused == 0
        # Degraded: nothing was forwarded while NATS was away.
        assert phase["down_forwarded"] == phase["still_down_forwarded"], phase
        # Healed: connected, both daemons and both instances known everywhere again.
        _wait(lambda: all(connected(a) for a in addrs), "daemons to reconnect")

        def healed() -> bool:
            for a in addrs:
                c = status(a).cluster
                if {d.daemon_id for d in c.daemons} != {"nr-d0", "nr-d1"}:
                    return False
                known = {i.instance_id: i.owner_daemon_id for i in c.instances if i.load_known}
                if known != {"nr0": "nr-d0", "nr1": "nr-d1"}:
                    return False
            return True

        _wait(healed, "the cluster to heal")
        before = forwarded()

        def indexed(addr: str, instance: str) -> int:
            got = [i for i in status(addr).cluster.instances if i.instance_id == instance]
            return got[0].num_indexed_blocks if got else 0

        fresh = [rng.randrange(3, 30000) for _ in range(128)]  # cached nowhere yet
        held_before = indexed(addrs[1], "nr0")

        async def send(d: int, i: int) -> Outcome:
            async with grpc.aio.insecure_channel(addrs[d]) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                s = Spec(f"nr-after-{i}", fresh + [i + 3, 5], 3)
                o = await generate(stub, s.message(), timeout=30)
                assert o.tokens == s.expected
                return o

        first = asyncio.run(send(0, 0))
        assert first.instance == "nr0"  # idle instances, nothing cached: d0 keeps it
        # nr0's KV events reach d1 (through the healed NATS) ...
        _wait(lambda: indexed(addrs[1], "nr0") > held_before, "d1 to index nr0's new blocks")
        # ... so d1 sends the same prefix to nr0: forwarded, cluster-wide routing is back.
        outs = [asyncio.run(send(1, i)) for i in range(1, 6)]
        assert all(o.instance == "nr0" for o in outs), [o.instance for o in outs]
        assert forwarded() >= before + 5
        for a in addrs:
            wait_pool_free(a, timeout=20)
    finally:
        if cluster is not None:
            cluster.stop()
        nats.close()
        import shutil

        shutil.rmtree(store, ignore_errors=True)
