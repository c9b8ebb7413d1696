"""Poison quarantine: a request that keeps taking its instance down is ended, not requeued.

A request is a *suspect* of an instance loss when it was on the instance and had made no
progress since it was placed there (no output token: its prefill or its first decode was in
flight when the workers were lost). Requests that produced tokens since their placement are not
suspects: the crash came from something they had already survived. A suspect is requeued as
before, but only one suspect of a model is on trial at a time (placed while no other suspect of
that model is live and still without progress), so an innocent request that happened to share
a crashing batch is not lost again with the poison one. A request that is a suspect
`poison_max_losses` times (config; default 2) ends with FINISH_REASON_ERROR and a message that
says so; it is logged and counted (`kvsched_requests_quarantined_total`).

Only losses that are the worker's fault count (`RequestTable.requeue_lost(worker_fault=True)`:
its stream broke, as a crash breaks it, or it broke the protocol). The cluster's faults are not
the request's: an instance whose lease a peer took, a rank silent past the heartbeat timeout (a
paused worker or daemon, a partition), a peer that went away or an adoption move the request
without counting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvsched.daemon")


def progressed(tr: Any) -> bool:
    """Whether the request produced output since its last placement."""
    return bool(len(tr.req.output_token_ids) > tr.out_at_place)


class PoisonGuard:
    def __init__(self, max_losses: int) -> None:
        self.max_losses = max_losses
        self.num_quarantined = 0
        self._trials: dict[str, Any] = {}  # model -> the suspect placed on trial

    def lost(self, tr: Any, reason: str) -> str | None:
        """`tr` was on an instance that was lost (`reason`). Returns the message it ends with
        when it is quarantined now, else None (requeue it)."""
        if progressed(tr):
            tr.losses = 0  # it ran past this placement's start: not what crashes the instance
            return None
        tr.losses += 1
        if tr.losses < self.max_losses:
            return None
        self.num_quarantined += 1
        message = (
            f"quarantined as a poison request: it was on an instance that was lost "
            f"{tr.losses} times before it produced a token (last: {reason}); it is not "
            f"requeued again (poison_max_losses = {self.max_losses})"
        )
        log.warning("request %s %s", tr.req.req_id, message)
        return message

    def may_place(self, tr: Any, live: Callable[[Any], bool]) -> bool:
        """Whether a requeued request may be placed now: always for a non-suspect; a suspect
        only while no other suspect of its model is on trial (live, no progress yet)."""
        if tr.losses == 0:
            return True
        trial = self._trials.get(tr.model)
        if trial is not None and trial is not tr and live(trial) and not progressed(trial):
            return False
        self._trials[tr.model] = tr
        return True
