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

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

OTHER = "other"


def tenant_label(engine: Any, tenant: str) -> str:
    """The label value for `tenant` on `engine`'s instance: its name if configured."""
    return tenant if tenant in engine.tenant_weights else OTHER


class TenantMetrics:
    def __init__(self, make_hist: Callable[[], Any]) -> None:
        self.make_hist = make_hist
        self.ttft: dict[tuple[str, str], Any] = {}  # (instance, tenant label) -> Hist

    def first_tokens(self, engine: Any, reqs: list[Any]) -> None:
        iid = engine.instance_id
        for req in reqs:
            key = (iid, tenant_label(engine, req.tenant))
            h = self.ttft.get(key)
            if h is None:
                h = self.ttft[key] = self.make_hist()
            h.observe(max(0.0, req.first_token_time - req.arrival_time))

    @staticmethod
    def _totals(engine: Any) -> tuple[dict[str, int], dict[str, int]]:
        """served and shed per label for one instance, earlier schedulers included."""
        served_raw, shed_raw = engine.tenant_counts()
        served: dict[str, int] = {}
        shed: dict[str, int] = {}
        _add(served, served_raw, engine)
        _add(shed, shed_raw, engine)
        return served, shed

    def families(self, engines: dict[str, Any], model: str) -> Iterator[Metric]:
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
        for iid, eng in list(engines.items()):
            s_tot, d_tot = self._totals(eng)
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


def _add(into: dict[str, int], counts: dict[str, int], engine: Any) -> None:
    for tenant, n in list(counts.items()):
        label = tenant_label(engine, tenant)
        into[label] = into.get(label, 0) + n
