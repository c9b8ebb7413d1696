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
from collections.abc import Mapping
from typing import Any

from kvsched.server.telemetry.metrics import Metrics
from kvsched.server.telemetry.tracing import Tracing, make_tracing

log = logging.getLogger("kvsched.daemon")


class Telemetry:
    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """A request was validated and queued. `carrier` holds the caller's gRPC metadata
        (W3C `traceparent` / `tracestate` when the client sent them)."""

    def lifecycle(self, engine: Any, events: Any) -> None:
        """One engine step's core Events: scheduled (resumed when num_preemptions > 0), first
        token, preempted, requeued. `engine.instance_id` names the instance."""

    def report_applied(self, engine: Any, report: Any) -> None:
        """A worker StepReport was folded in (batch size, tokens generated this step)."""

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

    def scheduler_step(self, instance_id: str, seconds: float) -> None:
        """One schedule() call took `seconds`."""

    async def start_metrics_server(self) -> int | None:
        """Serve /metrics where the config says; the bound port, or None when disabled."""
        return None

    def shutdown(self) -> None:
        """Flush exporters."""


class Observability(Telemetry):
    """Metrics always; tracing when `tracing` is set."""

    def __init__(
        self, daemon: Any, metrics: Metrics, tracing: Tracing | None, metrics_listen: str
    ) -> None:
        self.daemon = daemon
        self.metrics = metrics
        self.tracing = tracing
        self.metrics_listen = metrics_listen

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        if self.tracing is not None:
            self.tracing.request_accepted(tr, carrier)

    def lifecycle(self, engine: Any, events: Any) -> None:
        self.metrics.lifecycle(engine, events)
        if self.tracing is not None:
            self.tracing.lifecycle(engine, events)

    def report_applied(self, engine: Any, report: Any) -> None:
        self.metrics.report_applied(engine, report)

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

    def scheduler_step(self, instance_id: str, seconds: float) -> None:
        self.metrics.scheduler_step(instance_id, seconds)

    async def start_metrics_server(self) -> int | None:
        if not self.metrics_listen:
            return None
        return await self.metrics.start_server(self.metrics_listen)

    def shutdown(self) -> None:
        """End the spans of requests still live, flush the exporters, stop serving /metrics.
        Blocks until the span exporters are done (bounded by their export timeouts)."""
        self.metrics.close()
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            tracing.end_open(list(self.daemon.tracked.values()))
            tracing.shutdown()


def make_telemetry(config: Any, daemon: Any) -> Telemetry:
    """Metrics (always) and request tracing (as config and OTEL_* environment choose).
    `daemon` (the composition root's `Daemon`) is only read once it is built: its `engines`
    by the metrics (each step, each scrape), its `tracked` requests at shutdown."""
    metrics = Metrics(daemon, config.model)
    return Observability(daemon, metrics, make_tracing(config), config.metrics_listen)
