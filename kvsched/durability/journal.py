"""The journal: every accepted request of this daemon, durable in a JetStream stream.

    accept()     the accepted record, published and acknowledged (awaited) before the client
                 is told `queued`; refused with `Unavailable` when it cannot be stored
    run()        every flush_ms: each live request's new output tokens as one TokenDelta
                 (fire-and-forget publishes); after a NATS reconnect, every live request's
                 tokens in full (a gap left by the outage is repaired)
    progress()   one request's tokens now (its instance was lost, or it was handed off)
    finished()   the finished record (rolls the request's `req` subject up to it) and a purge
                 of its token deltas, in order, off the caller's path
    recover()    the unfinished requests this daemon owns, with their recorded tokens
    lookup()     the latest record of a request by id, on any daemon's subjects (Resume)

Subjects and records: records.py and journal.proto. Retention: finished records stay for
`journal_max_age_s` (a Resume of a finished request is answered from them), token deltas are
purged at finish, `journal_max_bytes` caps the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
)

from kvsched.codec import finished_to_proto
from kvsched.core import Request, Unavailable
from kvsched.durability import records as R
from kvsched.v1 import journal_pb2, request_service_pb2

log = logging.getLogger("kvsched.journal")

PURGE: dict[str, str] = {}  # an outbox entry with these headers purges its subject


class Journaled(Protocol):
    """What the journal reads of a tracked request (the daemon's `Tracked`)."""

    req: Request
    owner: str
    client_tag: str
    finished: bool
    durable: int  # 0: not journaled, 1: accepted record in flight, 2: stored
    journaled: int  # output tokens recorded


class Journal:
    def __init__(
        self,
        link: Any,  # kvsched.cluster.link.ClusterLink
        flush_ms: float = 100.0,
        timeout_s: float = 2.0,
        max_age_s: float = 86400.0,
        max_bytes: int = 1 << 30,
    ) -> None:
        self.link = link
        self.nc = link.nc
        self.js = link.js
        self.daemon_id: str = link.daemon_id
        self.flush_s = flush_ms / 1000.0
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._outbox: asyncio.Queue[tuple[str, bytes, dict[str, str] | None]] = asyncio.Queue()
        self._reconnects = 0
        self.num_accepted = 0
        self.num_refused = 0
        self.num_publish_errors = 0

    async def open(self) -> None:
        """Create the stream, or bring an existing one's limits to this config."""
        cfg = StreamConfig(
            name=R.STREAM,
            subjects=[f"{R.PREFIX}.>"],
            storage=StorageType.FILE,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            discard=DiscardPolicy.OLD,
            allow_rollup_hdrs=True,
            allow_direct=True,
        )
        try:
            await self.js.add_stream(cfg)
        except Exception:
            await self.js.update_stream(cfg)
        self._reconnects = self.nc.stats.get("reconnects", 0)

    # ---- writing ------------------------------------------------------------------------------
    async def accept(
        self, tr: Journaled, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> None:
        """Store the accepted record; `Unavailable` when NATS does not acknowledge it in time."""
        req_id = tr.req.req_id
        data = R.accepted_record(pb, req_id, self.daemon_id, instance, tr.owner, tr.client_tag)
        subject = R.req_subject(self.daemon_id, req_id)
        try:
            if not self.nc.is_connected:  # refuse at once: a buffered record could land later
                raise ConnectionError("not connected")
            tr.durable = 1
            await self.js.publish(subject, data, timeout=self.timeout_s)
        except Exception as exc:
            if tr.durable == 1:
                # It may still be stored (sent, then the link broke before the ack): purge it
                # after it, in order, so that a refused request leaves nothing behind.
                self._emit(subject, b"", PURGE)
            tr.durable = 0
            self.num_refused += 1
            raise Unavailable(
                f"the request journal (NATS JetStream at {self.link.url}) did not store the "
                f"request within {self.timeout_s:g} s ({type(exc).__name__}); nothing was "
                "accepted: retry, or check NATS"
            ) from None
        tr.durable = 2
        self.num_accepted += 1
        if tr.finished:  # it finished while its record was in flight
            self.finished(tr)

    def _emit(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self._outbox.put_nowait((subject, data, headers))

    def progress(self, tr: Journaled) -> None:
        """Record `tr`'s new output tokens now (written off the caller's path)."""
        self._deltas((tr,))

    def finished(self, tr: Journaled) -> None:
        """Record `tr`'s end (its one Finished is decided); the tokens go with it."""
        if tr.durable != 2:
            return  # not stored yet: accept() calls again once it is; or never journaled
        req = tr.req
        data = R.finished_record(
            req.req_id, self.daemon_id, tr.owner, list(req.output_token_ids), finished_to_proto(req)
        )
        tr.durable = 3
        self._emit(R.req_subject(self.daemon_id, req.req_id), data, {"Nats-Rollup": "sub"})
        if tr.journaled:
            self._emit(R.tok_subject(self.daemon_id, req.req_id), b"", PURGE)

    def _deltas(self, trs: Iterable[Journaled], full: bool = False) -> None:
        for tr in trs:
            if tr.durable != 2:
                continue
            out = tr.req.output_token_ids
            n = len(out)
            start = 0 if full else tr.journaled
            if n <= start:
                continue
            tr.journaled = n
            self._emit(R.tok_subject(self.daemon_id, tr.req.req_id), R.delta(start, out[start:n]))

    async def run(self, live: Callable[[], Iterable[Journaled]]) -> None:
        """Every flush_ms, each live request's new tokens (all of them after a NATS
        reconnect); the writer publishes what is queued, in order."""
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            while True:
                await asyncio.sleep(self.flush_s)
                reconnects = self.nc.stats.get("reconnects", 0)
                full = reconnects != self._reconnects
                self._reconnects = reconnects
                self._deltas(list(live()), full)
        finally:
            writer.cancel()

    async def _write(self) -> None:
        """Publish queued records in order (core publishes: the stream stores them; a loss is
        repaired by the next full delta); purges (requests) after the records before them."""
        box = self._outbox
        while True:
            items = [await box.get()]
            while not box.empty():
                items.append(box.get_nowait())
            purges = []
            for subject, data, headers in items:
                if headers is PURGE:
                    purges.append(self.js.purge_stream(R.STREAM, subject=subject))
                    continue
                try:
                    await self.nc.publish(subject, data, headers=headers)
                except Exception as exc:  # closed, or the reconnect buffer is full
                    self.num_publish_errors += 1
                    log.debug("journal publish to %s failed: %s", subject, exc)
            for r in await asyncio.gather(*purges, return_exceptions=True):
                if isinstance(r, BaseException):
                    log.debug("purging token deltas failed: %s", r)

    # ---- reading ------------------------------------------------------------------------------
    async def _read(self, subject: str, policy: DeliverPolicy) -> list[Any]:
        psub = await self.js.pull_subscribe(
            subject,
            config=ConsumerConfig(
                deliver_policy=policy, ack_policy=AckPolicy.NONE, inactive_threshold=30.0
            ),
        )
        try:
            left = (await psub.consumer_info()).num_pending or 0
            out: list[Any] = []
            while left > 0:
                msgs = await psub.fetch(min(left, 1000), timeout=max(self.timeout_s, 5.0))
                out.extend(msgs)
                left -= len(msgs)
            return out
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def recover(self) -> list[R.Unfinished]:
        """This daemon's accepted, unfinished requests with their recorded tokens, in the
        order they were accepted."""
        records = await self._read(f"{R.REQ}.{self.daemon_id}.>", DeliverPolicy.LAST_PER_SUBJECT)
        live: dict[str, R.Unfinished] = {}
        for msg in records:
            rec = R.parse_record(msg.data)
            if rec.kind == R.ACCEPTED:
                live[msg.subject.rsplit(".", 1)[1]] = R.Unfinished(rec)
        if live:
            for msg in await self._read(f"{R.TOK}.{self.daemon_id}.>", DeliverPolicy.ALL):
                u = live.get(msg.subject.rsplit(".", 1)[1])
                if u is not None:
                    R.apply_delta(u.tokens, msg.data)
        return list(live.values())

    async def lookup(self, req_id: str) -> journal_pb2.JournalRecord | None:
        """The latest record of `req_id` on any daemon's subjects; None when there is none."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(R.STREAM, f"{R.REQ}.*.{R.id_token(req_id)}")
        except NotFoundError:
            return None
        except Exception as exc:
            raise Unavailable(f"the request journal cannot be read now ({exc}); retry") from None
        return R.parse_record(msg.data)
