"""`AbortBus`: an Abort for a request this daemon does not track, asked of every daemon on the
NATS subject `kvsched.abort` (`ask`), and this daemon's answer to the others' asks: a request
it tracks (for that owner) is aborted here and the asker told so; otherwise it stays silent
(the asker times out when nobody has it)."""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

from kvsched.core.protocol import FinishReason

if TYPE_CHECKING:
    from kvsched.cluster.link import ClusterLink
    from kvsched.server.requests.table import RequestTable

ABORT_SUBJECT = "kvsched.abort"


class AbortBus:
    """Owns the `kvsched.abort` subscription (from `start` to `stop`)."""

    def __init__(self, link: ClusterLink, requests: RequestTable) -> None:
        self.link = link
        self.daemon_id = link.daemon_id
        self.requests = requests
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.link.nc.subscribe(ABORT_SUBJECT, cb=self._answer)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def ask(
        self, request_id: str, owner: str | None, reason: FinishReason = FinishReason.ABORT
    ) -> bool:
        """Ask every daemon to abort `request_id` (True: one of them tracked it), ending it with
        `reason` (ABORT or STOP: its client's own stop condition, counted as a stop)."""
        if not self.link.nc.is_connected:
            return False
        body = json.dumps(
            {
                "request_id": request_id,
                "owner": owner,
                "from": self.daemon_id,
                "reason": int(reason),
            }
        )
        try:
            await self.link.nc.request(ABORT_SUBJECT, body.encode(), timeout=1.0)
        except Exception:  # no daemon answered: nobody tracks it
            return False
        return True

    async def _answer(self, msg: Any) -> None:
        try:
            d = json.loads(msg.data)
            rid, owner = str(d["request_id"]), d.get("owner")
        except (ValueError, KeyError):
            return
        if d.get("from") == self.daemon_id:
            return
        tr = self.requests.tracked.get(rid)
        if tr is None or (owner is not None and tr.owner != owner):
            return  # not ours: stay silent (the asker times out when nobody has it)
        via = f"through daemon {d.get('from')}"
        if d.get("reason") == FinishReason.STOP:  # (an asker before the field: an abort)
            self.requests.abort_tracked(tr, f"stopped by client ({via})", FinishReason.STOP)
        else:
            self.requests.abort_tracked(tr, f"aborted by client ({via})")
        with contextlib.suppress(Exception):
            await msg.respond(b"ok")
