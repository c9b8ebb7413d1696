"""The step-cost model as the daemon shows it: GetStatus, `kvsched status`'s table and /metrics
give the predicted and measured worker step time of a real daemon fed by a real sim worker
whose steps cost what the H100 fit says."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsched.server.status_view import format_status
from kvsched.v1 import admin_service_pb2, admin_service_pb2_grpc
from tests.server.telemetry_harness import request, running_daemon
from tests.server.test_telemetry import sample, scrape


def test_status_and_metrics_show_predicted_and_measured_step_time() -> None:
    async def go() -> tuple[admin_service_pb2.GetStatusResponse, dict[Any, float]]:
        overrides = {"metrics_listen": "127.0.0.1:0", "model": "m1"}
        async with running_daemon(overrides, zero_cost=False) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            assert port
            gens = [h.generate(request(f"c{i}", 200 + 50 * i, 40, seed=i)) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*gens), 30)
            admin = admin_service_pb2_grpc.AdminServiceStub(h.channel)
            status = await asyncio.wait_for(
                admin.GetStatus(admin_service_pb2.GetStatusRequest()), 10
            )
            metrics = await asyncio.to_thread(scrape, port)
        return status, metrics

    status, metrics = asyncio.run(go())
    (inst,) = status.instances
    assert inst.itl_target_ms == 100.0
    # ~40 steps of a few ms each: learned (every step with prefill folds at once).
    assert 1.0 < inst.step_measured_ewma_ms < 50.0
    assert inst.step_predicted_ewma_ms == pytest.approx(inst.step_measured_ewma_ms, rel=0.5)
    assert inst.step_measured_ms > 0 and inst.step_predicted_ms > 0
    header, row = format_status(status).splitlines()[:2]
    assert "step ms pred/meas" in header
    assert f"{inst.step_measured_ewma_ms:.1f}" in row and "100 ms" in row
    measured = sample(metrics, "kvsched_step_time_measured_seconds")
    assert measured == pytest.approx(inst.step_measured_ewma_ms / 1e3, rel=0.5)
    assert sample(metrics, "kvsched_step_time_predicted_seconds") > 0
    assert sample(metrics, "kvsched_itl_target_seconds") == 0.1
    # Idle at the scrape: the target in force is the ITL target; steps of a few ms never
    # passed it (tests/core/test_step_cost.py shows both moving).
    assert sample(metrics, "kvsched_step_target_seconds") == 0.1
    assert sample(metrics, "kvsched_steps_over_itl_target_total") == 0
