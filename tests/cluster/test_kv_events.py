"""KV events over a real nats-server: a dropped batch is detected and repaired by a snapshot; a
daemon that joins late builds the same prefix index as the others."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvsched.cluster.hit_index import keys_of
from kvsched.cluster.kv_stream import KvStream
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.core import Scheduler
from kvsched.v1 import request_service_pb2_grpc
from tests.cluster.conftest import start_cluster
from tests.core.factories import make_request, make_scheduler, step
from tests.integration.clients import Spec, generate
from tests.integration.harness import start_daemon, status


def _run(s: Scheduler, prompts: list[list[int]]) -> None:
    for p in prompts:
        req = make_request(p, max_tokens=2)
        s.add_request(req)
        while not req.is_finished:
            step(s)
        s.check_integrity()


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_dropped_batch_is_detected_and_repaired(nats_server: NatsServer) -> None:
    async def go() -> None:
        sched = make_scheduler(block_size=16, num_gpu_blocks=64)
        sched.enable_kv_events()
        pub_link = await connect_cluster(nats_server.url, "kv-pub")
        sub_link = await connect_cluster(nats_server.url, "kv-sub")
        pub = KvStream(pub_link, lambda: {"g0": sched})
        sub = KvStream(sub_link, dict)
        await pub.start(publish_every_flush_s=False)
        await sub.start(publish_every_flush_s=False)
        try:

            def same() -> bool:
                v = sub.index.instances.get("g0")
                return (
                    v is not None
                    and v.synced
                    and v.hashes == set(keys_of(sched.cached_block_hashes()))
                )

            _run(sched, [list(range(k * 1000, k * 1000 + 70)) for k in range(3)])
            await pub.flush()
            await _until(same)
            seq_before = sub.index.instances["g0"].seq
            _run(sched, [list(range(k * 1000, k * 1000 + 70)) for k in range(3, 6)])
            pub.drop_next = True
            await pub.flush()  # this batch is lost
            await asyncio.sleep(0.2)
            assert not same(), "the lost batch's blocks are missing from the index"
            assert sub.index.instances["g0"].seq == seq_before
            _run(sched, [list(range(k * 1000, k * 1000 + 70)) for k in range(6, 8)])
            await pub.flush()  # seq jumps by 2: a gap
            await _until(same)
            assert sub.index.num_gaps == 1
            assert sub.index.num_snapshots >= 2  # the first sync, and the repair
        finally:
            for x in (pub, sub):
                await x.stop()
            for link in (pub_link, sub_link):
                await link.close()

    asyncio.run(go())


def test_late_joiner_builds_the_same_index(nats_server: NatsServer) -> None:
    cluster = start_cluster(nats_server.url, "lj", 2, 1)
    late = None
    try:

        async def traffic() -> None:
            for k in range(12):
                ch = grpc.aio.insecure_channel(cluster.addresses[k % 2])
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                s = Spec(f"lj-{k}", list(range(k * 500, k * 500 + 100 + k)), 3)
                o = await generate(stub, s.message(), timeout=30)
                assert o.tokens == s.expected
                await ch.close()

        asyncio.run(traffic())
        late, late_addr = start_daemon("--cluster", nats_server.url, "--daemon-id", "lj-late")
        addrs = [*cluster.addresses, late_addr]

        def digests(addr: str) -> dict[str, tuple[str, int]]:
            return {
                i.instance_id: (i.index_digest, i.num_indexed_blocks)
                for i in status(addr).cluster.instances
                if i.load_known
            }

        deadline = time.monotonic() + 30
        while True:
            views = [digests(a) for a in addrs]
            if set(views[0]) == {"lj0", "lj1"} and views[0] == views[1] == views[2]:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"indexes differ: {views}")
            time.sleep(0.1)
        assert all(n > 0 for _, n in views[0].values()), views[0]
        assert status(late_addr).cluster.num_snapshots >= 2
    finally:
        if late is not None:
            late.stop()
        cluster.stop()
