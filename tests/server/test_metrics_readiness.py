"""`kvsched_instance_ready` / `kvsched_instance_accepting`: what the alert rules in
examples/prometheus watch, scraped over HTTP from a daemon with a real sim worker."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc
from tests.server.telemetry_harness import running_daemon


def readiness(port: int) -> dict[str, tuple[float, float]]:
    """instance -> (ready, accepting), from one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("kvsched_instance_ready", "kvsched_instance_accepting"):
            col = 0 if family.name == "kvsched_instance_ready" else 1
            for s in family.samples:
                assert s.labels["model"] == "m1"
                out.setdefault(s.labels["instance"], [-1.0, -1.0])[col] = s.value
    return {iid: (v[0], v[1]) for iid, v in out.items()}


def test_instance_ready_and_accepting_follow_pause_and_a_lost_worker() -> None:
    async def go() -> list[dict[str, tuple[float, float]]]:
        seen = []
        overrides = {"metrics_listen": "127.0.0.1:0", "model": "m1"}
        async with running_daemon(overrides) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            assert port
            seen.append(await asyncio.to_thread(readiness, port))
            admin = admin_service_pb2_grpc.AdminServiceStub(h.channel)
            await admin.Pause(apb.PauseRequest(instance_id="i0"), timeout=10)
            seen.append(await asyncio.to_thread(readiness, port))
            await admin.Resume(apb.ResumeRequest(instance_id="i0"), timeout=10)
            seen.append(await asyncio.to_thread(readiness, port))
            await h.stop_worker("i0")

            async def lost() -> None:
                while h.daemon.engines["i0"].ready:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(lost(), 10)
            # The lost instance keeps its series, at 0: an alert needs the 0, not a gap.
            seen.append(await asyncio.to_thread(readiness, port))
        return seen

    connected, paused, resumed, lost = asyncio.run(go())
    assert connected == {"i0": (1.0, 1.0)}
    assert paused == {"i0": (1.0, 0.0)}
    assert resumed == {"i0": (1.0, 1.0)}
    assert lost == {"i0": (0.0, 0.0)}
