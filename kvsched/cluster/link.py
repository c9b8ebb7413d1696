"""The daemon's one connection to NATS and JetStream, and the buckets it opens.

`connect_cluster` fails with a message a person can act on when the server cannot be reached or
has no JetStream; everything else in kvsched.cluster takes a `ClusterLink`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from kvsched.core.errors import Unavailable

log = logging.getLogger("kvsched.cluster")


@dataclass
class ClusterLink:
    """A connected NATS client, its JetStream context, and this daemon's identity."""

    url: str
    daemon_id: str
    nc: Any  # nats.aio.client.Client
    js: JetStreamContext
    last_error: str = ""  # the NATS client's last error (why the link is down, when it is)
    reconnects: int = 0  # times the client reconnected (watchers restart on a change)
    # called (no arguments, on the event loop) after every reconnect: Membership refreshes at
    # once, the leases' watcher restarts (its ordered consumer may be gone on the server)
    on_reconnect: list[Callable[[], None]] = field(default_factory=list)

    async def keys_of(self, bucket: str) -> list[str]:
        """A KV bucket's keys, read from its stream's subjects: no consumer is created (nats-py's
        `KeyValue.keys()` creates an ordered consumer per call that the server keeps for
        minutes, and one per poll leaked hundreds; a reconnect storm hit the consumer limit).
        A deleted key whose marker is still stored is listed: its `get` raises
        KeyNotFoundError."""
        prefix = f"$KV.{bucket}."
        info = await self.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
        return [s[len(prefix) :] for s in (info.state.subjects or {})]

    async def bucket(self, name: str, ttl_s: float = 0.0, history: int = 1) -> KeyValue:
        """A JetStream KV bucket, created on first use (`ttl_s` 0: entries never expire)."""
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            config = KeyValueConfig(bucket=name, history=history, ttl=ttl_s or None)
            return await self.js.create_key_value(config=config)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Drain (deliver what is in flight) then close; a drain that does not finish within
        `timeout_s` (NATS away, a stuck subscriber) closes at once."""
        if self.nc.is_closed:
            return
        # asyncio.wait, not wait_for: a timed-out wait_for waits for the cancelled drain, and
        # a drain stuck on a subscriber may never finish one.
        drain = asyncio.get_running_loop().create_task(self.nc.drain())
        done, _ = await asyncio.wait({drain}, timeout=timeout_s)
        exc = drain.exception() if done else TimeoutError(f"over {timeout_s} s")
        if exc is not None:
            log.warning("NATS drain did not finish (%r): closing", exc)
            if not self.nc.is_closed:
                close = asyncio.get_running_loop().create_task(self.nc.close())
                await asyncio.wait({close}, timeout=2.0)


async def connect_cluster(
    url: str, daemon_id: str, connect_timeout_s: float = 2.0, attempts: int = 2
) -> ClusterLink:
    """Connect to NATS at `url` and check that JetStream answers; `Unavailable` otherwise."""

    link: ClusterLink | None = None

    async def quiet(exc: Exception) -> None:  # nats-py logs every failed attempt; one line is ours
        log.debug("nats: %s", exc)
        if link is not None:
            link.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def disconnected() -> None:
        if link is not None and not link.last_error:
            link.last_error = "disconnected from the NATS server"

    async def reconnected() -> None:
        if link is not None:
            link.last_error = ""
            link.reconnects += 1
            for hook in list(link.on_reconnect):
                try:
                    hook()
                except Exception as exc:  # one hook never stops the others
                    log.warning("after NATS reconnect: %r", exc)

    try:
        nc = await nats.connect(
            servers=[url],
            name=f"kvsched-{daemon_id}",
            connect_timeout=connect_timeout_s,
            max_reconnect_attempts=attempts,
            reconnect_time_wait=0.2,
            allow_reconnect=True,
            # A link that stops answering (a partition that drops packets, not connections) is
            # noticed within ~6 s, not nats-py's default 4 minutes, and then reconnected.
            ping_interval=2,
            max_outstanding_pings=3,
            error_cb=quiet,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise Unavailable(
            f"cannot reach NATS at {url} ({type(exc).__name__}: {exc}); start one with "
            "`kvsched nats`, fix --cluster, or run without --cluster for a standalone daemon"
        ) from None
    js = nc.jetstream()
    try:
        await js.account_info()
    except Exception as exc:
        await nc.close()
        raise Unavailable(
            f"NATS at {url} has no JetStream ({type(exc).__name__}: {exc}); "
            "start nats-server with --jetstream"
        ) from None
    # Once up, keep reconnecting for as long as the daemon lives: a NATS restart must heal.
    nc.options["max_reconnect_attempts"] = -1
    link = ClusterLink(url=url, daemon_id=daemon_id, nc=nc, js=js)
    return link
