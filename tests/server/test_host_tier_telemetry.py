"""The host-memory KV tier as an operator sees it: /metrics counters and gauges, the request
span's host_cache_hit event, and AdminService status, against a daemon with a sim worker that
announces a host tier (telemetry_harness)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc
from tests.server.telemetry_harness import OtlpReceiver, attributes, request, running_daemon
from tests.server.test_telemetry import by_request_id, sample, scrape


def test_host_hits_show_in_metrics_spans_and_status() -> None:
    """A 16-block GPU pool: r0's prompt is evicted by the fillers (write_back copies it to the
    host tier), then r0's prompt again ("again") is swapped back in: 3 blocks of 16 tokens."""
    receiver = OtlpReceiver()

    async def go() -> tuple[dict[Any, float], dict[Any, float], apb.InstanceStatus]:
        overrides = {
            "metrics_listen": "127.0.0.1:0",
            "model": "m1",
            "tracing_exporter": "otlp",
            "otlp_endpoint": f"127.0.0.1:{receiver.port}",
            "engine.cache.host_write_policy": "write_back",
        }
        async with running_daemon(overrides, num_gpu_blocks=16, num_host_blocks=64) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            before = await asyncio.to_thread(scrape, port)
            await asyncio.wait_for(h.generate(request("r0", 64, 4, seed=0)), 10)
            for i in range(1, 4):  # 200 + 8 tokens: 13 blocks each, evicting r0's
                await asyncio.wait_for(h.generate(request(f"f{i}", 200, 8, seed=i)), 10)
            again = await asyncio.wait_for(h.generate(request("again", 64, 4, seed=0)), 10)
            assert again.finished is not None and again.finished.usage.cached_tokens == 48
            after = await asyncio.to_thread(scrape, port)
            admin = admin_service_pb2_grpc.AdminServiceStub(h.channel)
            status = await admin.GetStatus(apb.GetStatusRequest(instance_id="i0"), timeout=5)
        return before, after, status.instances[0]

    try:
        before, after, st = asyncio.run(go())
    finally:
        receiver.stop()

    def delta(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert delta("kvsched_prefix_cache_host_hits_total") == 48
    assert delta("kvsched_kv_swap_in_blocks_total") == 3
    assert delta("kvsched_kv_swap_out_blocks_total") >= 3
    assert delta("kvsched_prefix_cache_hits_total") >= 48  # either tier
    assert 0 < sample(after, "kvsched_num_free_host_blocks") <= 64
    assert ("kvsched_host_kv_cache_usage_perc", (("instance", "i0"), ("model", "m1"))) in after
    assert st.num_host_blocks == 64 and st.prefix_cache_host_hit_tokens == 48
    assert st.num_swap_ins == 3 and st.num_swap_failures == 0
    spans = by_request_id(receiver)
    events = {e.name: e for e in spans["again"][1].events}
    assert "host_cache_hit" in events, [e.name for e in spans["again"][1].events]
    attrs = attributes(events["host_cache_hit"].attributes)
    assert attrs["kvsched.host_cached_tokens"] == 48 and attrs["kvsched.cached_tokens"] == 48
    assert "host_cache_hit" not in {e.name for e in spans["r0"][1].events}
