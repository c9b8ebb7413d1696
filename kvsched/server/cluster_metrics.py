"""The cluster's Prometheus families (a daemon started with `--cluster` only): which daemon
this is, and how it routed (docs/CLUSTER.md, docs/MONITORING.md). Reads the composition root's
`cluster_node` at scrape time; imports nothing of kvsched.cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric


def cluster_families(daemon: Any, model: str) -> Iterator[Metric]:
    """In a cluster only: which daemon this is (an info metric: join on `daemon_id`), and how
    it routed requests and kept its prefix index (docs/CLUSTER.md)."""
    node = getattr(daemon, "cluster_node", None)
    if node is None:
        return
    info = InfoMetricFamily(
        "kvsched_daemon", "This daemon's id in its cluster and the cluster's NATS URL."
    )
    info.add_metric([], {"daemon_id": node.daemon_id, "cluster": node.link.url})
    yield info
    st = node.cluster_status()
    lv = [node.daemon_id, model]
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
