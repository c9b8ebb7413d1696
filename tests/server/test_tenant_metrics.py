"""Per-tenant metrics of a real daemon fed by a real sim worker: served tokens, sheds and TTFT
by tenant, with configured tenants by name and every other tenant as "other"."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.server.telemetry_harness import request, running_daemon
from tests.server.test_telemetry import sample, scrape


def test_served_tokens_sheds_and_ttft_by_tenant() -> None:
    shapes = {"g1": ("gold", 40, 5), "g2": ("gold", 23, 7), "x": ("anon-x", 64, 3), "y": ("", 9, 2)}

    async def go() -> tuple[dict[Any, float], grpc.aio.AioRpcError]:
        overrides = {
            "metrics_listen": "127.0.0.1:0",
            "model": "m1",
            "engine.fairness.tenant_weights": {"gold": 3.0},
            "engine.fairness.shed": "shed",
        }
        async with running_daemon(overrides, num_gpu_blocks=512) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            assert port
            msgs = []
            for i, (rid, (tenant, n, m)) in enumerate(shapes.items()):
                msg = request(rid, n, m, seed=i)
                msg.tenant = tenant
                msgs.append(msg)
            for msg in msgs:  # one at a time: no prefix sharing, exact counts
                await asyncio.wait_for(h.generate(msg), 30)
            # ~230 ms of predicted prefill for 8,000 tokens: a 1 ms deadline cannot be met.
            hopeless = request("late", 8000, 2, seed=99)
            hopeless.tenant, hopeless.ttft_deadline_ms = "gold", 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(h.generate(hopeless), 30)
            metrics = await asyncio.to_thread(scrape, port)
        return metrics, err.value

    metrics, err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted time to first token" in (err.details() or "")
    served = "kvsched_tenant_served_tokens_total"
    assert sample(metrics, served, tenant="gold") == (40 + 5) + (23 + 7)
    assert sample(metrics, served, tenant="other") == (64 + 3) + (9 + 2)
    assert sample(metrics, served, tenant="anon-x") == 0  # not configured: no series of its own
    shed = "kvsched_tenant_requests_shed_total"
    assert sample(metrics, shed, tenant="gold") == 1
    assert sample(metrics, shed, tenant="other") == 0
    ttft = "kvsched_tenant_time_to_first_token_seconds_count"
    assert sample(metrics, ttft, tenant="gold") == 2
    assert sample(metrics, ttft, tenant="other") == 2
