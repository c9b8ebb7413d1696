"""The host-memory KV tier's gauges, built at scrape time beside the other kvsched_* families
(`metrics._Collector`); its counters (host hits, swaps) are in metrics._COUNTERS."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric


def host_tier_families(daemon: Any, model: str, labels: list[str]) -> Iterator[Metric]:
    """kvsched_host_kv_cache_usage_perc and kvsched_num_free_host_blocks per instance with a
    host tier (instances without one are not listed)."""
    usage = GaugeMetricFamily(
        "kvsched_host_kv_cache_usage_perc",
        "Fraction of host-tier KV blocks in use (0-1; free cached blocks count as free).",
        labels=labels,
    )
    free = GaugeMetricFamily(
        "kvsched_num_free_host_blocks", "Host-tier KV blocks free (cached or empty).", labels=labels
    )
    for iid, eng in list(daemon.engines.items()):
        snap = eng.snapshot()
        if snap is None or not snap.num_host_blocks:
            continue
        usage.add_metric([iid, model], snap.host_cache_usage)
        free.add_metric([iid, model], snap.num_free_host_blocks)
    yield usage
    yield free
