"""The daemon's hooks for tracing and metrics. The base class does nothing; the observability
layer fills these in. Hooks are called per lifecycle event, never per token."""

from __future__ import annotations

from typing import Any


class Telemetry:
    def request_accepted(self, tr: Any) -> None:
        """A request was validated and queued."""

    def lifecycle(self, engine: Any, events: Any) -> None:
        """Scheduled / first token / preempted / requeued events of one engine step."""

    def request_finished(self, tr: Any) -> None:
        """A request reached its one finished state."""

    def scheduler_step(self, instance_id: str, seconds: float) -> None:
        """One schedule() call took `seconds`."""
