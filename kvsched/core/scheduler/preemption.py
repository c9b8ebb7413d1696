"""Preemption's decisions as plain functions: which running request gives up its blocks
(`choose_victim`), and the admission reserve that a preemption raises and quiet steps decay
(`reserve_in_force`, `decayed`). Who is preempted and when is `exits.Exits`'s (it holds the
reserve); these only decide.

Imports nothing of the package.
"""

from __future__ import annotations

from kvsched.core.config import CacheConfig, QueuePolicy, SchedulerConfig
from kvsched.core.request import Request
from kvsched.core.scheduler.events import SchedulerStats


def choose_victim(
    running: dict[str, Request], sc: SchedulerConfig, stats: SchedulerStats, exclude: Request | None
) -> Request | None:
    """The request the policy gives up first: LIFO (priority policy: lowest priority, then
    latest arrival). Requests at max_preemptions are spared (counted in `stats`). None: no
    request but `exclude` can go."""
    cap = sc.max_preemptions
    if sc.policy == QueuePolicy.PRIORITY:
        cands = sorted(
            (r for r in running.values() if r is not exclude),
            key=lambda r: (r.priority, r.arrival_time),
            reverse=True,
        )
    else:
        cands = [r for r in reversed(running.values()) if r is not exclude]
    for r in cands:
        if cap and r.num_preemptions >= cap:
            stats.count_preemption_skip()
            continue
        return r
    return None


def reserve_in_force(reserve: float, relaxed: bool, cc: CacheConfig) -> int:
    """Blocks held back per running request when admitting (0 once relaxed)."""
    if relaxed:
        return 0
    return max(int(reserve), cc.reserve_min, 0)


def decayed(reserve: float, cc: CacheConfig) -> tuple[float, bool]:
    """The reserve after a step that preempted nothing while requests ran, and whether it is
    off from now on (it reached 0)."""
    reserve -= cc.reserve_decay
    return reserve, max(int(reserve), cc.reserve_min, 0) == 0
