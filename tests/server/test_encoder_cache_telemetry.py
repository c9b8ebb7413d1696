"""The encoder cache as an operator sees it: /metrics hit and miss counters and AdminService
status, against a daemon with a sim worker (telemetry_harness)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2
from tests.server.telemetry_harness import request, running_daemon
from tests.server.test_telemetry import sample, scrape


def test_encoder_cache_hits_and_misses_show_in_metrics_and_status() -> None:
    """Four requests, each with its own text and an image: cat, dog, cat, cat. Two misses,
    two hits; a cache of 100 embeddings holds both 40-embedding items."""

    async def go() -> tuple[dict[Any, float], dict[Any, float], apb.InstanceStatus]:
        overrides = {
            "metrics_listen": "127.0.0.1:0",
            "model": "m1",
            "engine.cache.encoder_cache_size": 100,
        }
        async with running_daemon(overrides) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            before = await asyncio.to_thread(scrape, port)
            for i, item in enumerate(["cat", "dog", "cat", "cat"]):
                msg = request(f"r{i}", 96, 2, seed=i)
                msg.mm_ranges.append(
                    common_pb2.MultimodalRange(offset=16, length=40, content_hash=item)
                )
                await asyncio.wait_for(h.generate(msg), 10)
            after = await asyncio.to_thread(scrape, port)
            admin = admin_service_pb2_grpc.AdminServiceStub(h.channel)
            status = await admin.GetStatus(apb.GetStatusRequest(instance_id="i0"), timeout=5)
        return before, after, status.instances[0]

    before, after, st = asyncio.run(go())

    def delta(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert delta("kvsched_encoder_cache_hits_total") == 2
    assert delta("kvsched_encoder_cache_misses_total") == 2
    assert st.encoder_cache_size == 100 and st.encoder_cache_used == 80
    assert (st.encoder_cache_hits, st.encoder_cache_misses, st.encoder_cache_evictions) == (2, 2, 0)
