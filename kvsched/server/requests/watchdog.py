"""`Watchdog`: the request table's clocks, run by the daemon's watchdog pass (every 0.1 s,
daemon/app.py). It owns the queue-timeout and deadline timers (a heap: `start` sets a tracked
request's, `expired` pops the ones that passed with why each ends: a deadline, or a queue
timeout while the request was never scheduled; the table aborts those it still tracks), the
open streams it cuts when their client stopped reading (`cut_stalled`), and whether this
daemon stood still lately (`tick` / `stood_still`: instance losses then are not the workers'
fault). It writes no field of a request's record."""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.requests.record import Tracked

log = logging.getLogger("kvsched.daemon")


class Watchdog:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.timers: list[tuple[float, int, Tracked, str]] = []  # heap: when, seq, request, kind
        self._timer_seq = 0
        self.streams: set[Any] = set()  # open Generate / Session sinks (stall watchdog)
        self._last_tick = 0.0  # the watchdog's last pass (`tick`)
        self._stood_still_until = 0.0  # losses until then are not the workers' fault

    def start(self, tr: Tracked, deadline_s: float | None, queue_timeout: bool) -> None:
        """`tr`'s timers, from now: its queue timeout (`queue_timeout`: it has one, when
        queue_timeout_s is on) and its call's deadline (`deadline_s` from now; None: none)."""
        now = time.monotonic()
        if queue_timeout and self.config.queue_timeout_s > 0:
            self.add(now + self.config.queue_timeout_s, tr, "queue")
        if deadline_s is not None:
            self.add(now + deadline_s, tr, "deadline")

    def expired(self, now: float) -> Iterator[tuple[Tracked, str]]:
        """The requests whose timers passed by `now`, popped, each with why it ends: its
        deadline, or its queue timeout while it was never scheduled (else nothing ends)."""
        for tr, kind in self.due(now):
            if kind == "deadline":
                yield tr, "deadline exceeded (the call's gRPC deadline passed)"
            elif tr.req.first_scheduled_time < 0:
                yield tr, f"queue timeout: not scheduled within {self.config.queue_timeout_s:g} s"

    def add(self, when: float, tr: Tracked, kind: str) -> None:
        """A timer of `kind` ("queue" or "deadline") for `tr` at `when` (monotonic)."""
        self._timer_seq += 1
        heapq.heappush(self.timers, (when, self._timer_seq, tr, kind))

    def due(self, now: float) -> Iterator[tuple[Tracked, str]]:
        """The timers that passed by `now`, popped (O(expired) per pass)."""
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, tr, kind = heapq.heappop(timers)
            yield tr, kind

    def tick(self, now: float) -> None:
        """The watchdog's pass (every 0.1 s). A gap longer than heartbeat_interval_s means this
        daemon stood still (SIGSTOP, a stalled host): its workers may have left it as silent,
        so instance losses seen until heartbeat_timeout_s later are not their fault."""
        if self._last_tick and now - self._last_tick > self.config.heartbeat_interval_s:
            self._stood_still_until = now + self.config.heartbeat_timeout_s
        self._last_tick = now

    def stood_still(self, now: float) -> bool:
        """Whether this daemon stands still or just did (`tick`): the watchdog has not run
        for more than heartbeat_interval_s, or ran late lately."""
        gap = now - self._last_tick if self._last_tick else 0.0
        return now < self._stood_still_until or gap > self.config.heartbeat_interval_s

    def cut_stalled(self, now: float) -> None:
        """Cut streams with news their client has not read for more than stall_timeout_s."""
        limit = self.config.stall_timeout_s
        for sink in list(self.streams):
            since = sink.pending_since
            if since is not None and now - since > limit and sink.task is not None:
                log.warning("cutting a stream that has not read its outputs for %.1f s", limit)
                sink.stalled = True
                self.streams.discard(sink)
                sink.task.cancel()
