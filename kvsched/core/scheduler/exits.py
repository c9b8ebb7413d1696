"""The ways a placed request leaves its slot, each once: finish (and abort), preempt (with the
admission reserve it raises), requeue when the worker acknowledges a preempt, the prefill
role's hand-off, and pausing the instance. Every one releases through the placement table and
then updates, explicitly, what depends on what it freed: the backlog and the tenants'
counters, the outbox (the preempt the worker must be told), the events and counters.

`Exits` owns the admission reserve (`reserve_in_force`) and `paused`. Imports `table`,
`backlog`, `outbox`, `preemption` and `events`.
"""

from __future__ import annotations

from collections.abc import Callable

import kvsched.core.lifecycle as lifecycle
from kvsched.core.config import EngineConfig, QueuePolicy
from kvsched.core.protocol import FinishReason
from kvsched.core.request import Request
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import Events, SchedulerStats
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.preemption import choose_victim, decayed, reserve_in_force
from kvsched.core.scheduler.table import PlacementTable


class Exits:
    """Finish, preempt, requeue, hand-off and pause; owns the admission reserve and `paused`."""

    def __init__(
        self,
        config: EngineConfig,
        table: PlacementTable,
        backlog: Backlog,
        outbox: Outbox,
        events: Events,
        stats: SchedulerStats,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._table, self._backlog, self._outbox = table, backlog, outbox
        self._events, self._stats, self._clock = events, stats, clock
        cc = config.cache
        # Blocks held back per running request when admitting: reserve_blocks at first and after
        # each preemption, less reserve_decay each step that preempts nothing while requests
        # run, never below reserve_min; off (`_relaxed`) once it reaches 0.
        self._reserve = float(cc.reserve_blocks)
        self._relaxed = cc.reserve_blocks == 0
        self.paused = False

    def finish(self, req: Request, reason: FinishReason, message: str = "") -> None:
        """req ends here (finished, aborted, failed): blocks and slot back, no longer live."""
        freed = self._table.remove(req)
        self._backlog.released(req, freed)
        lifecycle.finish(req, reason, message, self._clock())
        self._stats.count_finished(reason)
        self._events.finished.append(req)

    def hand_off(self, req: Request) -> None:
        """Prefill role: req's first token is reported, so its KV has been pushed to the decode
        instance; it leaves here without finishing."""
        freed = self._table.remove(req)
        self._backlog.released(req, freed)
        self._events.handed_off.append(req)

    # ==== preemption ==========================================================================
    def preempt(self, req: Request) -> None:
        """Free req's blocks and slot now; the preempt goes out in the next Tasks, ahead of any
        task reusing them. It re-enters the queue when the worker acknowledges (`requeue`)."""
        freed = self._table.release(req)
        self._backlog.released(req, freed)
        lifecycle.preempt(req)
        self._stats.count_preemption()
        self._outbox.preempt(req.handle)
        cc = self._config.cache
        self._reserve = float(cc.reserve_blocks)
        self._relaxed = cc.reserve_blocks == 0
        self._events.preempted.append(req)

    def preempt_victim(self, for_req: Request) -> Request:
        """Preempt the request the policy would give up first and return it (for_req itself
        when it is the only choice)."""
        victim = choose_victim(self._table.running, self._config.scheduler, self._stats, for_req)
        if victim is None:
            victim = for_req
        self.preempt(victim)
        return victim

    def priority_preempt_for(self, req: Request) -> bool:
        """Priority policy with priority_preemption: make room for a waiting request by
        preempting a strictly lower-priority running one. True if one was preempted."""
        sc = self._config.scheduler
        if not (sc.policy == QueuePolicy.PRIORITY and sc.priority_preemption):
            return False
        victim = choose_victim(self._table.running, sc, self._stats, None)
        if victim is None or victim.priority <= req.priority:
            return False
        self.preempt(victim)
        return True

    def requeue(self, req: Request) -> None:
        """A preempted request the worker acknowledged: waiting again, at the queue's front."""
        self._table.unplace(req)
        lifecycle.requeue(req)
        self._backlog.push_front(req)
        self._events.requeued.append(req)

    def pause(self) -> list[Request]:
        """Preempt everything running and hold admissions (around weight updates)."""
        self.paused = True
        victims = list(reversed(self._table.running.values()))
        for req in victims:
            self.preempt(req)
        return victims

    def resume(self) -> None:
        self.paused = False

    # ==== the admission reserve ===============================================================
    def decay_reserve(self) -> None:
        if not self._relaxed:
            self._reserve, self._relaxed = decayed(self._reserve, self._config.cache)

    @property
    def reserve_blocks_per_running(self) -> int:
        """The admission reserve in force now (0 once relaxed)."""
        return reserve_in_force(self._reserve, self._relaxed, self._config.cache)
