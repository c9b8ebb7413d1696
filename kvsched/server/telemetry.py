"""The daemon's hooks for tracing and metrics.

The base class does nothing. Hooks run on lifecycle events and once per worker report, never per
token, so a step with 1024 running requests pays O(1) here plus O(events).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Telemetry:
    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """A request was validated and queued. `carrier` holds the caller's gRPC metadata
        (W3C `traceparent` / `tracestate` when the client sent them)."""

    def lifecycle(self, engine: Any, events: Any) -> None:
        """One engine step's core Events: scheduled (resumed when num_preemptions > 0), first
        token, preempted, requeued. `engine.instance_id` names the instance."""

    def report_applied(self, engine: Any, report: Any) -> None:
        """A worker StepReport was folded in (batch size, tokens generated this step)."""

    def request_finished(self, tr: Any) -> None:
        """A request reached its one finished state (tr.req carries status, usage, timings)."""

    def scheduler_step(self, instance_id: str, seconds: float) -> None:
        """One schedule() call took `seconds`."""

    def shutdown(self) -> None:
        """Flush exporters."""


def make_telemetry(config: Any, daemon: Any) -> Telemetry:
    """The telemetry the config asks for (the observability layer plugs in here)."""
    return Telemetry()
