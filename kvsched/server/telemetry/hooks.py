"""The daemon's hooks for tracing and metrics.

`Telemetry` is the request table's first lifecycle observer (server/requests/record.py's `Lifecycle`:
request_accepted / _moved / _progressed / _finished) and the engines' step hooks.

The base class does nothing. Hooks run on lifecycle events and once per worker report, never per
token, so a step with 1024 running requests pays O(1) here plus O(events).

`make_telemetry` returns an `Observability`: Prometheus metrics always (`metrics.py`: plain
counters and scrape-time reads, cheap), request spans when an exporter is chosen (`tracing.py`,
`tracing_setup.py`; with none, no SDK provider exists and the span hooks are skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvsched.server.telemetry.metrics import Metrics
from kvsched.server.telemetry.tracing import Tracing, make_tracing
from kvsched.server.telemetry.values import ClusterFacts, InstanceFacts, InstanceInfo, StepStats

log = logging.getLogger("kvsched.daemon")


class Telemetry:
    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """A request was validated and queued. `carrier` holds the caller's gRPC metadata
        (W3C `traceparent` / `tracestate` when the client sent them)."""

    def lifecycle(self, instance: InstanceInfo, events: Any) -> None:
        """One engine step's core Events: scheduled (resumed when num_preemptions > 0), first
        token, preempted, requeued, on the instance `instance` describes."""

    def report_applied(self, step: StepStats) -> None:
        """A worker StepReport was folded in (its batch size, the tokens generated so far)."""

    def request_moved(self, tr: Any, reason: str) -> None:
        """The instance holding the request was lost (`reason`); it was re-queued to be
        recomputed elsewhere. Called after `tr.req` was replaced, before it is placed again."""

    def request_progressed(self, tr: Any) -> None:
        """Its tokens should be recorded now (the journal's hook; nothing to trace)."""

    def request_refused(
        self, request_id: str, reason: str, message: str, carrier: Mapping[str, str]
    ) -> None:
        """A request was refused at submission (never accepted): `reason` is a short label."""
        log.info("request %s refused (%s): %s", request_id or "-", reason, message)

    def request_quarantined(self, tr: Any) -> None:
        """A request was ended as poison (server/requests/poison.py); its finish follows."""

    def request_finished(self, tr: Any) -> None:
        """A request reached its one finished state (tr.req carries status, usage, timings)."""

    def scheduler_step(self, step: StepStats) -> None:
        """One schedule() call took `step.seconds`."""

    def read_facts_from(
        self,
        instances: Callable[[], Mapping[str, InstanceFacts]],
        cluster: Callable[[], ClusterFacts | None],
    ) -> None:
        """Where scrape-time figures come from: each instance's published facts (the
        registry's), and the cluster's (None: alone). Handed in by the composition root."""

    async def start_metrics_server(self) -> int | None:
        """Serve /metrics where the config says; the bound port, or None when disabled."""
        return None

    def shutdown(self, live: list[Any] | None = None) -> None:
        """Flush exporters; `live`: the requests still tracked (their spans end here)."""


class Observability(Telemetry):
    """Metrics always; tracing when `tracing` is set."""

    def __init__(self, metrics: Metrics, tracing: Tracing | None, metrics_listen: str) -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.metrics_listen = metrics_listen

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        if self.tracing is not None:
            self.tracing.request_accepted(tr, carrier)

    def lifecycle(self, instance: InstanceInfo, events: Any) -> None:
        self.metrics.lifecycle(instance, events)
        if self.tracing is not None:
            self.tracing.lifecycle(instance, events)

    def report_applied(self, step: StepStats) -> None:
        self.metrics.report_applied(step)

    def request_moved(self, tr: Any, reason: str) -> None:
        if self.tracing is not None:
            self.tracing.request_moved(tr, reason)

    def request_refused(
        self, request_id: str, reason: str, message: str, carrier: Mapping[str, str]
    ) -> None:
        self.metrics.refusals.count(request_id, reason, message)
        if self.tracing is not None:
            self.tracing.request_refused(request_id, reason, message, carrier)

    def request_quarantined(self, tr: Any) -> None:
        self.metrics.refusals.quarantined += 1

    def request_finished(self, tr: Any) -> None:
        self.metrics.request_finished(tr)
        if self.tracing is not None:
            self.tracing.request_finished(tr)

    def scheduler_step(self, step: StepStats) -> None:
        self.metrics.scheduler_step(step)

    def read_facts_from(
        self,
        instances: Callable[[], Mapping[str, InstanceFacts]],
        cluster: Callable[[], ClusterFacts | None],
    ) -> None:
        self.metrics.instance_facts, self.metrics.cluster_facts = instances, cluster

    async def start_metrics_server(self) -> int | None:
        if not self.metrics_listen:
            return None
        return await self.metrics.start_server(self.metrics_listen)

    def shutdown(self, live: list[Any] | None = None) -> None:
        """End the spans of the requests still live, flush the exporters, stop serving
        /metrics. Blocks until the span exporters are done (bounded by their export
        timeouts)."""
        self.metrics.close()
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            tracing.end_open(live or [])
            tracing.shutdown()


def make_telemetry(config: Any) -> Telemetry:
    """Metrics (always) and request tracing (as config and OTEL_* environment choose). Nothing
    here reads the daemon's parts: the engines hand each step's numbers in as values
    (`StepStats`, `InstanceInfo`), and a scrape reads the instances' published facts through
    the function `read_facts_from` is given."""
    metrics = Metrics(config.model)
    return Observability(metrics, make_tracing(config), config.metrics_listen)
