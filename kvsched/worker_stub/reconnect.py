"""How the worker's session (session.py) reconnects: which refusals are final (`WorkerError`),
which are retried, a daemon's redirect (`Redirected`), and `Backoff`, which owns the retry
state: the jittered exponential delay, the daemon to try next in a cluster list, and the
outage (no daemon reached) it reports once and gives up on past `give_up_after_s`."""

from __future__ import annotations

import logging
import random
import time

import grpc

from kvsched.core.errors import KvschedError

log = logging.getLogger("kvsched.worker_stub.session")

# The daemon refused this worker: retrying the same hello cannot help.
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def still_attached(e: grpc.aio.AioRpcError) -> bool:
    """The daemon refused the hello because this rank's old stream is still attached there."""
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and "already connected" in (
        e.details() or ""
    )


class WorkerError(KvschedError):
    """The daemon refused this worker for good (bad hello, credentials, protocol version)."""


class Redirected(Exception):
    """The daemon reached does not own this instance: go to `address` (protocol step 11)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(reason)
        self.address = address


class Backoff:
    """The retry state of one worker's sessions: the next delay (jittered, doubling up to
    `max_s`, back to `min_s` after a session that ran `max_s` or longer) and the current outage
    (`unreachable_since`: None while the last session was welcomed)."""

    def __init__(self, backoff_s: tuple[float, float], give_up_after_s: float) -> None:
        self.min_s, self.max_s = backoff_s
        self.give_up_after_s = give_up_after_s
        self._next = self.min_s
        # No daemon reached since then (None: the last session was welcomed); with
        # give_up_after_s > 0, unreachable() raises WorkerError once it has lasted that long.
        self.unreachable_since: float | None = None

    def delay(self, started: float) -> float:
        """The wait before the next try, for a session that started at `started` (monotonic)."""
        if time.monotonic() - started >= self.max_s:
            self._next = self.min_s  # it ran a while: not a crash loop
        delay = self._next * random.uniform(0.5, 1.0)
        self._next = min(2 * self._next, self.max_s)
        return delay

    def reached(self, server: str) -> None:
        """A session was welcomed: the outage, if any, is over."""
        if self.unreachable_since is not None:
            log.info("reached the daemon at %s", server)
            self.unreachable_since = None

    def unreachable(self, e: grpc.aio.AioRpcError, servers: list[str], server: str) -> None:
        """A session that never reached a daemon: say so once per outage (then quietly retry
        with backoff); raise WorkerError past give_up_after_s."""
        now = time.monotonic()
        if self.unreachable_since is None:
            self.unreachable_since = now
            give_up = (
                f"; giving up after {self.give_up_after_s:g} s"
                if self.give_up_after_s > 0
                else " (--give-up-after S to stop trying)"
            )
            log.error(
                "cannot reach any daemon at %s (%s: %s): is `kvsched serve` running there "
                "and the address right? retrying with backoff up to %g s between tries%s",
                ",".join(servers),
                e.code().name,
                e.details(),
                self.max_s,
                give_up,
            )
        else:
            log.debug("still no daemon at %s: %s", server, e.details())
        if self.give_up_after_s > 0 and now - self.unreachable_since >= self.give_up_after_s:
            raise WorkerError(
                f"no daemon reachable at {','.join(servers)} for "
                f"{self.give_up_after_s:g} s: giving up"
            ) from e


def next_server(servers: list[str], server: str) -> str:
    """The daemon to try after `server` in a cluster's list (the first when it is not there)."""
    if len(servers) <= 1:
        return server
    i = servers.index(server) if server in servers else -1
    return servers[(i + 1) % len(servers)]
