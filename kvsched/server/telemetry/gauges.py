"""The cluster's Prometheus families (a daemon started with `--cluster` only): which daemon
this is, and how it routed (docs/CLUSTER.md, docs/MONITORING.md).

The host-memory KV tier's gauges, built at scrape time beside the other kvsched_* families
(`metrics._Collector`); its counters (host hits, swaps) are in metrics._COUNTERS.

Each instance's step-cost model as gauges, built at scrape time beside the other kvsched_*
families (`metrics._Collector`).

Each instance's LoRA adapters as vLLM's `lora_requests_info` (`lora_families`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from kvsched.server.telemetry.values import ClusterFacts, InstanceFacts


def cluster_families(cluster: ClusterFacts | None, model: str) -> Iterator[Metric]:
    """In a cluster only: which daemon this is (an info metric: join on `daemon_id`), and how
    it routed requests and kept its prefix index (docs/CLUSTER.md)."""
    if cluster is None:
        return
    info = InfoMetricFamily(
        "kvsched_daemon", "This daemon's id in its cluster and the cluster's NATS URL."
    )
    info.add_metric([], {"daemon_id": cluster.daemon_id, "cluster": cluster.url})
    yield info
    st = cluster.status
    lv = [cluster.daemon_id, model]
    for name, doc, value in (
        (
            "cluster_routed_local",
            "New requests routed to this daemon's own instances.",
            st.num_routed_local,
        ),
        (
            "cluster_forwarded",
            "New requests forwarded to a peer daemon's instance.",
            st.num_forwarded,
        ),
        (
            "cluster_kv_event_gaps",
            "Gaps found in peers' KV-event sequences (each repaired by a snapshot).",
            st.num_event_gaps,
        ),
    ):
        fam = CounterMetricFamily(f"kvsched_{name}", doc, labels=["daemon_id", "model"])
        fam.add_metric(lv, value)
        yield fam


def host_tier_families(
    facts: Mapping[str, InstanceFacts], model: str, labels: list[str]
) -> Iterator[Metric]:
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
    for iid, f in facts.items():
        snap = f.snapshot
        if snap is None or not snap.num_host_blocks:
            continue
        usage.add_metric([iid, model], snap.host_cache_usage)
        free.add_metric([iid, model], snap.num_free_host_blocks)
    yield usage
    yield free


def step_cost_families(
    facts: Mapping[str, InstanceFacts], model: str, labels: list[str]
) -> Iterator[Metric]:
    """Each instance's step-cost model: a worker step's time as predicted and as measured
    (moving averages), the ITL target and the step target in force (its steps past the
    ITL target are a counter with the others, metrics.py)."""
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
        GaugeMetricFamily(
            "kvsched_step_target_seconds",
            "Time the scheduler last planned a worker step to: the ITL target, or longer while "
            "prompts wait behind decodes that fill it (scheduler.queue_drain_steps).",
            labels=labels,
        ),
    ]
    for iid, f in facts.items():
        snap = f.snapshot
        if snap is None:
            continue
        values = (
            snap.step_predicted_ewma_ms,
            snap.step_measured_ewma_ms,
            snap.itl_target_ms,
            snap.step_target_ms,
        )
        for family, ms in zip(families, values, strict=True):
            family.add_metric([iid, model], ms / 1e3)
    yield from families


def lora_families(facts: Mapping[str, InstanceFacts], model: str) -> Iterator[Metric]:
    """vLLM's `vllm:lora_requests_info` per instance running LoRA adapters (its `max_lora` and
    the adapters of its running and waiting requests, comma-separated, as labels; the value is
    the scrape's Unix time, as vLLM's is its last update's): what the Gateway API inference
    extension and llm-d read for adapter affinity. Instances with no adapter limit and no
    adapter in use are left out, as vLLM leaves it out without LoRA."""
    family = GaugeMetricFamily(
        "kvsched_lora_requests_info",
        "Running stats on LoRA requests (vLLM's vllm:lora_requests_info).",
        labels=[
            "instance",
            "model",
            "max_lora",
            "running_lora_adapters",
            "waiting_lora_adapters",
        ],
    )
    now = time.time()
    for iid, f in facts.items():
        lora = f.lora
        if lora is None or not (lora.max_loras or lora.running or lora.waiting):
            continue
        family.add_metric(
            [
                iid,
                f.model or model,
                str(lora.max_loras),
                ",".join(sorted(lora.running)),
                ",".join(sorted(lora.waiting)),
            ],
            now,
        )
    yield family
