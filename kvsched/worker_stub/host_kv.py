"""The worker's side of the host-memory KV tier: executing the daemon's copies between GPU
blocks and host blocks at a step boundary, and what the next report says about them.

The executor holds the memory (`swap_out(gpu_ids, host_ids)`, `swap_in(host_ids, gpu_ids)`,
`drop_host()`; an executor without them fails every copy, which is reported, never fatal). A
report after copies ran is due even with no rows: its applied_seq acknowledges them (the
daemon then registers the host blocks written and releases its pins). A failed swap-out is
reported by host block id; a failed swap-in by handle, and that handle does not run (the
engine drops its chunks) until the daemon's preempt arrives: the request recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

from kvsched.core.protocol import StepReport

log = logging.getLogger(__name__)


class HostCopies:
    """Runs copies on an executor and keeps what the next report must say about them."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.failed_outs: list[int] = []  # host block ids
        self.failed_ins: dict[int, None] = {}  # handles
        self.copied = False  # copies ran since the last report
        self.ahead: dict[int, int] = {}  # handle -> blocks swapped in ahead, this boundary

    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        """GPU blocks -> host blocks, one batch; a failed batch is reported."""
        self.copied = True
        try:
            self.executor.swap_out(gpu_ids, host_ids)
        except Exception:
            log.warning("swap-out of %d blocks failed", len(gpu_ids), exc_info=True)
            self.failed_outs.extend(host_ids)

    def swap_in(
        self,
        handles: list[int],
        host_ids: list[int],
        gpu_ids: list[int],
        ahead: set[int] | None = None,
    ) -> list[int]:
        """Host blocks -> GPU blocks, one batch per handle (its run is contiguous). Returns the
        handles whose copy failed. Handles in `ahead` have no chunk in their message (their
        swap-ins went ahead of it, `CacheConfig.swap_in_ahead`): copied as any, then an
        executor with a copy stream (`copies_ahead`) runs them beside the next step;
        `ahead_read(handle)` says a chunk at the same boundary reads them after all."""
        self.copied = True
        failed: list[int] = []
        i, n = 0, len(handles)
        while i < n:
            j = i
            while j < n and handles[j] == handles[i]:
                j += 1
            try:
                self.executor.swap_in(host_ids[i:j], gpu_ids[i:j])
                if ahead and handles[i] in ahead:
                    self.executor.copies_ahead(j - i, 0)
                    self.ahead[handles[i]] = j - i
            except Exception:
                log.warning("swap-in for handle %d failed", handles[i], exc_info=True)
                self.failed_ins[handles[i]] = None
                failed.append(handles[i])
            i = j
        return failed

    def ahead_read(self, handle: int) -> None:
        """A chunk at this boundary reads `handle`'s swap-ins sent ahead: before the step."""
        n = self.ahead.pop(handle, 0)
        if n:
            self.executor.copies_read(n, 0)

    def drop(self) -> None:
        """reset_prefix_cache: the daemon names no host block it knew before again."""
        drop = getattr(self.executor, "drop_host", None)
        if drop is not None:
            drop()

    @property
    def pending(self) -> bool:
        return self.copied

    def fill(self, report: StepReport) -> None:
        """Put the failures into the report; the copies are acknowledged by it."""
        if self.copied:
            report.failed_swap_outs, self.failed_outs = self.failed_outs, []
            report.failed_swap_ins = list(self.failed_ins)
            self.failed_ins.clear()
            self.copied = False
