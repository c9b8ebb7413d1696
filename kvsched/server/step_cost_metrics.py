"""Each instance's step-cost model as gauges, built at scrape time beside the other kvsched_*
families (`metrics._Collector`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric


def step_cost_families(daemon: Any, model: str, labels: list[str]) -> Iterator[Metric]:
    """Each instance's step-cost model: a worker step's time as predicted and as measured
    (moving averages), and the time target in force."""
    families = [
        GaugeMetricFamily(
            "kvsched_step_time_predicted_seconds",
            "Worker step time the step-cost model predicted (moving average).",
            labels=labels,
        ),
        GaugeMetricFamily(
            "kvsched_step_time_measured_seconds",
            "Worker step time the workers measured (moving average).",
            labels=labels,
        ),
        GaugeMetricFamily(
            "kvsched_itl_target_seconds",
            "Time budget of a worker step while requests decode (0: off).",
            labels=labels,
        ),
    ]
    for iid, eng in list(daemon.engines.items()):
        snap = eng.snapshot()
        if snap is None:
            continue
        values = (snap.step_predicted_ewma_ms, snap.step_measured_ewma_ms, snap.itl_target_ms)
        for family, ms in zip(families, values, strict=True):
            family.add_metric([iid, model], ms / 1e3)
    yield from families
