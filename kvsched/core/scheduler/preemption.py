"""Preemption: which running request gives up its blocks (`_choose_victim`), doing it
(`_preempt`, through the one exit path), and the admission reserve that a preemption raises and
quiet steps decay (`_decay_reserve`, `reserve_blocks_per_running`).

Imported by the step (admission) and the scheduler facade; imports only `placement`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsched.core.config import EngineConfig, QueuePolicy
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.placement import Placements


class Preemption(Placements):
    """Victims, preempting them, and the admission reserve (owns `_reserve`, `_relaxed`)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        instance_id: str = "",
        first_handle: int = 0,
    ) -> None:
        super().__init__(config, clock, instance_id, first_handle)
        cc = self.config.cache
        # Blocks held back per running request when admitting: reserve_blocks at first and after
        # each preemption, less reserve_decay each step that preempts nothing while requests
        # run, never below reserve_min; off (`_relaxed`) once it reaches 0.
        self._reserve = float(cc.reserve_blocks)
        self._relaxed = cc.reserve_blocks == 0

    def pause(self) -> list[Request]:
        """Preempt everything running and hold admissions (around weight updates)."""
        self.paused = True
        victims = list(reversed(self.running.values()))
        for req in victims:
            self._preempt(req)
        return victims

    def resume(self) -> None:
        self.paused = False

    def _preempt_victim(self, for_req: Request) -> Request | None:
        """Preempt the request the policy would give up first and return it. LIFO (priority
        policy: lowest priority, then latest arrival); requests at max_preemptions are spared
        unless nothing else is left. Returns for_req itself when it is the only choice."""
        victim = self._choose_victim(exclude=for_req)
        if victim is None:
            victim = for_req
        self._preempt(victim)
        return victim

    def _choose_victim(self, exclude: Request | None) -> Request | None:
        sc = self.config.scheduler
        cap = sc.max_preemptions
        if sc.policy == QueuePolicy.PRIORITY:
            cands = sorted(
                (r for r in self.running.values() if r is not exclude),
                key=lambda r: (r.priority, r.arrival_time),
                reverse=True,
            )
        else:
            cands = [r for r in reversed(self.running.values()) if r is not exclude]
        for r in cands:
            if cap and r.num_preemptions >= cap:
                self.stats.num_preemption_skips += 1
                continue
            return r
        return None

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and slot now; the preempt goes out in the next Tasks, ahead of any
        task reusing them. It re-enters the queue when the worker acknowledges."""
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._pending_preempts.append(req.handle)
        self._reserve = float(self.config.cache.reserve_blocks)
        self._relaxed = self.config.cache.reserve_blocks == 0
        self.events.preempted.append(req)

    def _priority_preempt_for(self, req: Request) -> bool:
        """Priority policy with priority_preemption: make room for a waiting request by
        preempting a strictly lower-priority running one. True if one was preempted."""
        sc = self.config.scheduler
        if not (sc.policy == QueuePolicy.PRIORITY and sc.priority_preemption):
            return False
        victim = self._choose_victim(exclude=None)
        if victim is None or victim.priority <= req.priority:
            return False
        self._preempt(victim)
        return True

    def _decay_reserve(self) -> None:
        cc = self.config.cache
        if self._relaxed:
            return
        self._reserve -= cc.reserve_decay
        if max(int(self._reserve), cc.reserve_min, 0) == 0:
            self._relaxed = True

    @property
    def reserve_blocks_per_running(self) -> int:
        """The admission reserve in force now (0 once relaxed)."""
        if self._relaxed:
            return 0
        return max(int(self._reserve), self.config.cache.reserve_min, 0)
