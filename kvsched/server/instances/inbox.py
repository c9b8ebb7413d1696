"""The StepReports an instance's ranks sent that its engine loop has not applied yet, the
wake-up that runs the loop, and the recent reports' arrival times (`steps_per_s`, for status).

Imported by `engine` only; asyncio, no kvsched state.
"""

from __future__ import annotations

import asyncio
import collections
import time

from kvsched.core.protocol import StepReport


class ReportInbox:
    """Reports queued for the engine loop, in arrival order, and the loop's wake-up event."""

    def __init__(self) -> None:
        self._reports: list[StepReport] = []
        self._wake = asyncio.Event()
        self._times: collections.deque[float] = collections.deque(maxlen=256)

    def wake(self) -> None:
        """Let the loop run one step (a burst of wakes before it runs costs one step)."""
        self._wake.set()

    def submit(self, report: StepReport) -> None:
        self._reports.append(report)
        self._times.append(time.monotonic())
        self._wake.set()

    async def wait(self) -> None:
        """Until the next wake (cleared as it returns)."""
        await self._wake.wait()
        self._wake.clear()

    def take(self) -> list[StepReport]:
        """Every report not applied yet; the inbox starts empty again."""
        reports, self._reports = self._reports, []
        return reports

    def pending(self) -> list[StepReport]:
        """The reports queued, not applied yet (a copy)."""
        return list(self._reports)

    def clear(self) -> None:
        """Drop the queued reports (their instance was taken out)."""
        self._reports.clear()

    def steps_per_s(self) -> float:
        """Reports per second over the last 256 received (0 with fewer than two)."""
        times = self._times
        if len(times) < 2:
            return 0.0
        span = time.monotonic() - times[0]
        return (len(times) - 1) / span if span > 0 else 0.0
