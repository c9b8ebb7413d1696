"""Per-tenant metrics (scheduling rule 12 in docs/ARCHITECTURE.md): served tokens, requests
shed or demoted, and time to first token, labelled by `tenant`.

Label values are bounded: a tenant listed in an instance's `fairness.tenant_weights` is
labelled by its name, every other one (the empty tenant included) as "other", so a client
inventing tenant names cannot grow the series. Served tokens and sheds are the core's own
counters, read at scrape time from the engine (`InstanceEngine.tenant_counts`: totalled over
every scheduler the instance has had, so the exported totals never go backwards when a new
scheduler starts from 0 after its workers reconnect).
TTFT is observed from the lifecycle hook at the first token, as the per-instance histogram.

Imported by `metrics` only; imports nothing of kvsched (histograms come from its caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

OTHER = "other"


def tenant_label(weights: Mapping[str, float], tenant: str) -> str:
    """The label value for `tenant` on an instance with these tenant weights: its name if
    configured."""
    return tenant if tenant in weights else OTHER


class TenantMetrics:
    def __init__(self, make_hist: Callable[[], Any]) -> None:
        self.make_hist = make_hist
        self.ttft: dict[tuple[str, str], Any] = {}  # (instance, tenant label) -> Hist

    def first_tokens(self, instance: Any, reqs: list[Any]) -> None:
        iid, weights = instance.instance_id, instance.tenant_weights
        for req in reqs:
            key = (iid, tenant_label(weights, req.tenant))
            h = self.ttft.get(key)
            if h is None:
                h = self.ttft[key] = self.make_hist()
            h.observe(max(0.0, req.first_token_time - req.arrival_time))

    @staticmethod
    def _totals(f: Any) -> tuple[dict[str, int], dict[str, int]]:
        """served and shed per label for one instance (its `InstanceFacts`), earlier
        schedulers included."""
        served: dict[str, int] = {}
        shed: dict[str, int] = {}
        _add(served, f.served, f.tenant_weights)
        _add(shed, f.shed, f.tenant_weights)
        return served, shed

    def families(self, facts: Mapping[str, Any], model: str) -> Iterator[Metric]:
        labels = ["instance", "model", "tenant"]
        served = CounterMetricFamily(
            "kvsched_tenant_served_tokens",
            "Tokens served per tenant: prompt tokens handed to the worker plus output tokens.",
            labels=labels,
        )
        shed = CounterMetricFamily(
            "kvsched_tenant_requests_shed",
            "Requests whose TTFT deadline was predicted missed: shed or demoted (fairness.shed).",
            labels=labels,
        )
        for iid, f in facts.items():
            s_tot, d_tot = self._totals(f)
            for tenant, n in sorted(s_tot.items()):
                served.add_metric([iid, model, tenant], n)
            for tenant, n in sorted(d_tot.items()):
                shed.add_metric([iid, model, tenant], n)
        ttft = HistogramMetricFamily(
            "kvsched_tenant_time_to_first_token_seconds",
            "Time from arrival to the first output token, per tenant.",
            labels=labels,
        )
        for (iid, tenant), h in sorted(self.ttft.items()):
            ttft.add_metric([iid, model, tenant], h.cumulative(), h.sum)
        yield served
        yield shed
        yield ttft


def _add(into: dict[str, int], counts: Mapping[str, int], weights: Mapping[str, float]) -> None:
    for tenant, n in list(counts.items()):
        label = tenant_label(weights, tenant)
        into[label] = into.get(label, 0) + n
