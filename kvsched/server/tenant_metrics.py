"""Per-tenant metrics (scheduling rule 12 in docs/ARCHITECTURE.md): served tokens, requests
shed or demoted, and time to first token, labelled by `tenant`.

Label values are bounded: a tenant listed in an instance's `fairness.tenant_weights` is
labelled by its name, every other one (the empty tenant included) as "other", so a client
inventing tenant names cannot grow the series. Served tokens and sheds are the core's own
counters (`Scheduler.tenants`), read at scrape time; like the scheduler's other counters they
restart with a new scheduler when an instance's workers reconnect (kept per scheduler object
here, folded into a base when it is replaced, so the exported totals never go backwards).
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
    sched = engine.sched
    weights = sched.config.fairness.tenant_weights if sched is not None else {}
    return tenant if tenant in weights else OTHER


class TenantMetrics:
    def __init__(self, make_hist: Callable[[], Any]) -> None:
        self.make_hist = make_hist
        self.ttft: dict[tuple[str, str], Any] = {}  # (instance, tenant label) -> Hist
        # (instance) -> (scheduler object, its served/shed totals folded from earlier ones)
        self._base: dict[str, tuple[Any, dict[str, int], dict[str, int]]] = {}

    def first_tokens(self, engine: Any, reqs: list[Any]) -> None:
        iid = engine.instance_id
        for req in reqs:
            key = (iid, tenant_label(engine, req.tenant))
            h = self.ttft.get(key)
            if h is None:
                h = self.ttft[key] = self.make_hist()
            h.observe(max(0.0, req.first_token_time - req.arrival_time))

    def _totals(self, iid: str, engine: Any) -> tuple[dict[str, int], dict[str, int]]:
        """served and shed per label for one instance, earlier schedulers included."""
        sched = engine.sched
        old_sched, served_base, shed_base = self._base.get(iid, (None, {}, {}))
        if old_sched is not None and old_sched is not sched:
            _add(served_base, old_sched.tenants.served, engine)
            _add(shed_base, old_sched.tenants.shed, engine)
        self._base[iid] = (sched, served_base, shed_base)
        served, shed = dict(served_base), dict(shed_base)
        if sched is not None:
            _add(served, sched.tenants.served, engine)
            _add(shed, sched.tenants.shed, engine)
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
            s_tot, d_tot = self._totals(iid, eng)
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
