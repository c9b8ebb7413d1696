"""Acknowledged JetStream publishes, pipelined: the journal's accepted records.

`nats-py`'s `js.publish` is one request per record: a new inbox token, a future, a
`wait_for` timer, the reply's JSON parsed into a `PubAck`, and a flush of the connection of its
own. Every accepted record must be acknowledged before its client is told `queued` (the
guarantee is the same here), but the records of concurrent accepts need not each pay for that:

    publish()   queue one record; `then(None)` is called when JetStream acknowledges it, or
                `then(exc)` when it does not (the stream's error, no stream, not sent, or no
                acknowledgement within `timeout_s`): called at once from the acknowledgement's
                delivery, not scheduled (one event-loop turn fewer per record); without `then`,
                a future that ends the same way
    _drain()    one task publishes everything queued since it was woken, each with its own
                reply subject under this publisher's inbox, then one timer for them all
    _on_ack()   the acknowledgements (one wildcard subscription): an ack without an
                `"error"` is the record stored; only an error's JSON is parsed

Each record is acknowledged (or refused) alone: a batch never decides for its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from nats.js.errors import APIError, NoStreamResponseError

log = logging.getLogger("kvsched.journal")

Then = Callable[[BaseException | None], None]  # a record's fate: None (stored) or why not


class AckedPublisher:
    def __init__(self, nc: Any, timeout_s: float) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._prefix = ""
        self._pending: dict[str, Then] = {}
        self._queue: list[tuple[str, bytes, dict[str, str] | None, Then]] = []
        self._drainer: asyncio.Task[None] | None = None
        self._n = 0
        self._sub: Any = None
        self.num_published = 0
        self.num_batches = 0  # drains that sent something: records per batch = published / this

    async def open(self) -> None:
        """Subscribe to this publisher's acknowledgements (once per connection object: the
        subscription survives NATS reconnects)."""
        if self._sub is None:
            self._prefix = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_ack)

    @property
    def in_flight(self) -> int:
        """Records published and not acknowledged yet, or queued."""
        return len(self._pending) + len(self._queue)

    def publish(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None = None,
        then: Then | None = None,
    ) -> asyncio.Future[None] | None:
        """Queue one record; `then` (or the future returned when there is none) learns its
        fate, exactly once."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] | None = None
        if then is None:
            fut = loop.create_future()
            then = _resolver(fut)
        self._queue.append((subject, data, headers, then))
        if self._drainer is None:
            self._drainer = loop.create_task(self._drain())
        return fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[tuple[str, bytes, dict[str, str] | None, Then]] = []
        try:
            while self._queue:  # records queued while this one published join the next round
                batch, self._queue = self._queue, []
                batch.reverse()  # popped from the end: in order, and what is left is unsent
                tokens = []
                while batch:
                    subject, data, headers, then = batch.pop()
                    if not self.nc.is_connected:  # not buffered: it could land after a refusal
                        then(ConnectionError("not connected"))
                        continue
                    self._n += 1
                    token = str(self._n)
                    self._pending[token] = then
                    try:
                        await self.nc.publish(
                            subject, data, reply=self._prefix + token, headers=headers
                        )
                    except Exception as exc:  # closed, the reconnect buffer full, too large
                        if self._pending.pop(token, None) is not None:
                            then(exc)
                        continue
                    tokens.append(token)
                if tokens:
                    self.num_published += len(tokens)
                    self.num_batches += 1
                    loop.call_later(self.timeout_s, self._expire, tokens)
        finally:
            self._drainer = None
            # Cancelled (the loop closes) or a fate's callback failed: what was not sent is
            # refused, never left without a fate.
            for *_, then in [*reversed(batch), *self._queue]:
                with contextlib.suppress(Exception):
                    then(ConnectionError("the journal's publisher stopped"))
            self._queue = []

    def _expire(self, tokens: list[str]) -> None:
        for token in tokens:
            then = self._pending.pop(token, None)
            if then is not None:
                then(TimeoutError(f"no acknowledgement within {self.timeout_s:g} s"))

    async def _on_ack(self, msg: Any) -> None:
        then = self._pending.pop(msg.subject[len(self._prefix) :], None)
        if then is not None:  # else expired already (it was refused), or not ours
            try:
                then(ack_error(msg.data))
            except Exception:  # not into nats-py's error callback, which logs at debug
                log.exception("journal: settling an acknowledged record failed")

    def fail_all(self, exc: BaseException) -> None:
        """Every record not acknowledged yet is refused with `exc` (the link closes)."""
        pending, self._pending = self._pending, {}
        queued, self._queue = self._queue, []
        for then in [*pending.values(), *(q[3] for q in queued)]:
            then(exc)


def _resolver(fut: asyncio.Future[None]) -> Then:
    def then(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    return then


def ack_error(data: bytes) -> Exception | None:
    """None when `data` is a JetStream publish acknowledgement (`{"stream":..,"seq":..}`);
    the error otherwise. An empty reply is NATS's no-responders status: no stream takes
    the subject."""
    if not data:
        return NoStreamResponseError()
    if b'"error"' not in data:
        return None
    try:
        resp = json.loads(data)
    except ValueError:
        return APIError(description=f"unreadable acknowledgement {data[:80]!r}")
    if isinstance(resp, dict) and isinstance(resp.get("error"), dict):
        try:
            APIError.from_error(resp["error"])  # raises the error's own class
        except APIError as exc:
            return exc
        except (KeyError, TypeError):
            return APIError(description=f"JetStream error {resp['error']!r}")
    return None
