"""One instance's scheduler (`Scheduler`) and what it hands out: `Events` with their typed
token deltas, `SchedulerStats`, `SchedulerSnapshot`. See scheduler.py for the map of the parts.

Importers outside the package use these names; the parts themselves import nothing from here.
"""

from kvsched.core.scheduler.admission import StepBudget
from kvsched.core.scheduler.events import (
    SNAPSHOT_COUNTERS,
    DecodeColumn,
    Events,
    LoraState,
    RowTokens,
    SchedulerSnapshot,
    SchedulerStats,
    TokenDelta,
)
from kvsched.core.scheduler.outbox import MAX_ADAPTIVE_HEADROOM
from kvsched.core.scheduler.scheduler import Scheduler

__all__ = [
    "MAX_ADAPTIVE_HEADROOM",
    "SNAPSHOT_COUNTERS",
    "DecodeColumn",
    "Events",
    "LoraState",
    "RowTokens",
    "Scheduler",
    "SchedulerSnapshot",
    "SchedulerStats",
    "StepBudget",
    "TokenDelta",
]
