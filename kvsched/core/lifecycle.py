"""A request's life as one state machine: the only writer of its lifecycle fields.

    queue ──> WAITING ──place──> RUNNING ──finish──> FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}
                ^                   │ preempt
                └──── requeue ──── PREEMPTED (blocks freed; waiting for the worker's ack)

Every transition is one named call here, whoever decides it: the scheduler's parts (backlog:
queue, demote; placement table: place; report: first_token; exits: preempt, requeue, finish),
the router (its choice says `demoted`; the caller applies it), and the daemon for requests no
scheduler holds (`finish_outside`: parked, a failed hand-off, a peer's Finished with its
timings; `carry_over`: a fresh copy that keeps the old one's identity and timings). The fields
(`LIFECYCLE_FIELDS`) are written nowhere else (tests/test_layout_owners.py checks it): a reader
of this module sees every way a request's status, times and counts can change.

Pure: no clock of its own; callers pass `now` from theirs.
"""

from __future__ import annotations

from kvsched.core.protocol import FinishReason
from kvsched.core.request import FINISHED_STATUS, Request, RequestStatus

# The fields only this module writes.
LIFECYCLE_FIELDS = (
    "status",
    "finish_reason",
    "finish_message",
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "finished_time",
    "num_preemptions",
    "demoted",
)


def queue(req: Request, now: float) -> None:
    """A new request enters a scheduler's queue: WAITING, its arrival stamped unless it came
    with one (a request that moved keeps its first arrival)."""
    req.status = RequestStatus.WAITING
    if req.arrival_time == 0.0:
        req.arrival_time = now


def demote(req: Request) -> None:
    """Its deadline is predicted missed (shed policy "demote", or every instance overflowed):
    queued behind every request that is not."""
    req.demoted = True


def place(req: Request, now: float) -> None:
    """It got a slot: RUNNING; its first scheduling time kept from its first placement (a
    request moved off a lost instance keeps it)."""
    req.status = RequestStatus.RUNNING
    if req.first_scheduled_time < 0:
        req.first_scheduled_time = now


def hold(req: Request) -> None:
    """Decode role: a slot held for a request whose KV another instance pushes."""
    req.status = RequestStatus.RUNNING


def scheduled_again(req: Request, now: float) -> None:
    """Decode role: the pushed KV arrived; it is scheduled here from now."""
    req.first_scheduled_time = now


def first_token(req: Request, now: float) -> bool:
    """Its first output token was reported; True if this is the first time (a request that
    moved keeps its first token's time)."""
    if req.first_token_time >= 0:
        return False
    req.first_token_time = now
    return True


def preempt(req: Request) -> None:
    """Its blocks and slot are freed; it waits for the worker's acknowledgement."""
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1


def requeue(req: Request) -> None:
    """The worker acknowledged its preemption: WAITING again."""
    req.status = RequestStatus.WAITING


def finish(req: Request, reason: FinishReason, message: str, now: float) -> None:
    """It ends (finished, aborted, failed), in a scheduler or outside any (`finish_outside`)."""
    req.status = FINISHED_STATUS[reason]
    req.finish_reason = reason
    req.finish_message = message
    req.finished_time = now


def finish_outside(req: Request, reason: FinishReason, message: str, now: float) -> None:
    """It ends where no scheduler holds it (parked, a failed hand-off, a reservation gone)."""
    finish(req, reason, message, now)


def finish_remote(
    req: Request,
    reason: FinishReason,
    message: str,
    now: float,
    queue_s: float,
    ttft_s: float,
    e2e_s: float,
) -> None:
    """It ended on a peer daemon: the peer's timings moved onto this clock, from the
    request's arrival here (ttft_s 0: no token came)."""
    t0 = req.arrival_time
    req.first_scheduled_time = t0 + queue_s
    if ttft_s > 0:
        req.first_token_time = t0 + ttft_s
    finish(req, reason, message, max(now, t0 + e2e_s))


def relayed(req: Request, now: float, tokens: bool) -> None:
    """News from the peer that runs it: queued there (first scheduling time), or tokens
    (first token time); each stamped once."""
    if tokens:
        first_token(req, now)
    elif req.first_scheduled_time < 0:
        req.first_scheduled_time = now


def carry_over(old: Request, new: Request) -> None:
    """`new` is a fresh copy of `old` (placed anew, or a decode instance's after hand-off):
    it keeps old's arrival, first scheduling and first token times and its preemptions."""
    new.arrival_time = old.arrival_time
    new.first_scheduled_time = old.first_scheduled_time
    new.first_token_time = old.first_token_time
    new.num_preemptions = old.num_preemptions
