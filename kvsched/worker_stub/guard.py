"""What a worker trusts of the daemon it is connected to (protocol steps 8 and 12).

    guard = DaemonGuard(instance_id)
    guard.heard()                     # on every message the daemon sends
    guard.check_epoch(epoch, "Tasks") # raise Fenced below the highest fencing epoch seen
    await guard.watch_silence(welcomed)   # raise DaemonSilent past the Welcome's bound

Fencing: the daemon stamps its lease's epoch on Welcome and every Tasks; the worker obeys only
the highest it has seen for its instance (a lower one is a daemon that lost the lease).
Silence: a daemon that sends nothing (no Tasks, no heartbeat) for Welcome.silence_timeout_ns is
left, as is one that sends no Welcome that long on a later connect.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("kvsched.worker_stub.session")


class Fenced(Exception):
    """The daemon sent a fencing epoch below the highest this worker has seen for its instance:
    it lost the instance's lease. Drop the stream; try the next daemon."""


class DaemonSilent(Exception):
    """The daemon sent nothing for longer than its Welcome.silence_timeout_ns (paused, hung,
    cut off): drop the stream and try the next daemon."""


class DaemonGuard:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.fencing_epoch = 0  # the highest any daemon stamped for this instance
        self.silence_timeout_s = 0.0  # the last Welcome's bound (0: none)
        self.last_heard = 0.0
        self.num_fenced = 0  # streams dropped for a lower epoch
        self.num_silent = 0  # streams left for silence

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def check_epoch(self, epoch: int, what: str) -> None:
        """Obey only the highest fencing epoch seen for this instance (raise Fenced below it)."""
        if epoch < self.fencing_epoch:
            raise Fenced(
                f"its {what} carries fencing epoch {epoch}, below {self.fencing_epoch} already "
                f"seen for instance {self.instance_id}: it lost the lease; dropping the stream"
            )
        if epoch > self.fencing_epoch:
            if self.fencing_epoch:
                old = self.fencing_epoch
                log.info("instance %s: fencing epoch %d -> %d", self.instance_id, old, epoch)
            self.fencing_epoch = epoch

    async def watch_silence(self, welcomed: asyncio.Event) -> None:
        """Raise DaemonSilent once the daemon has sent nothing for silence_timeout_s."""
        while True:
            bound = self.silence_timeout_s
            if bound <= 0:
                await asyncio.sleep(0.5)  # no bound (yet): look again after a welcome
                continue
            quiet = time.monotonic() - self.last_heard
            if quiet >= bound:
                what = "anything" if welcomed.is_set() else "a Welcome"
                raise DaemonSilent(
                    f"no {what} from it for {quiet:.2f} s (bound {bound:g} s, the Welcome's "
                    "silence_timeout_ns): trying the next daemon"
                )
            await asyncio.sleep(bound - quiet)
