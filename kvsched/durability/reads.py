"""`JournalReader`: what the journal reads back from its JetStream stream, never writing it.

    unfinished(owner)  one daemon's accepted, unfinished requests with their recorded tokens
                       (recovery at start, and the seam of a takeover of a dead peer's journal)
    lookup(req_id)     a request's finished record, or its accepted one on any daemon (Resume),
                       following a takeover's tombstones to the adopter (`ADOPTED_BY`)
    last(subject)      the stream's last message on a subject (the compare-and-set of a takeover
                       reads who won)

Each full read is an ephemeral pull consumer, deleted as soon as it is read. Subjects and
records: records.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvsched.core import Unavailable
from kvsched.durability import records as R
from kvsched.v1 import journal_pb2


class JournalReader:
    def __init__(self, js: Any, timeout_s: float) -> None:
        self.js = js  # the link's JetStream context
        self.timeout_s = timeout_s

    async def read(self, subject: str, policy: DeliverPolicy) -> list[Any]:
        """Every message on `subject` the stream holds now, by `policy`."""
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
            with contextlib.suppress(Exception):  # now, not after its inactive threshold
                await self.js.delete_consumer(psub._stream, psub._consumer)

    async def unfinished(self, owner: str) -> list[R.Unfinished]:
        """The accepted, unfinished requests of daemon `owner`, with their recorded tokens.
        The records and the token deltas are read at once (two consumers side by side: a
        takeover's clients wait for this read, ~4 round trips each): the deltas are the
        owner's in their order either way, and those of requests not unfinished are skipped."""
        records, deltas = await asyncio.gather(
            self.read(f"{R.REQ}.{owner}.>", DeliverPolicy.LAST_PER_SUBJECT),
            self.read(R.tok_subject(owner), DeliverPolicy.ALL),
        )
        live: dict[str, R.Unfinished] = {}
        for msg in records:
            if msg.data:  # empty: a finished request's tombstone
                rec = R.parse_record(msg.data)
                if rec.kind == R.ACCEPTED:
                    live[rec.request_id] = R.Unfinished(rec, seq=msg.metadata.sequence.stream)
        if live:
            tokens_of = {rid: u.tokens for rid, u in live.items()}
            for msg in deltas:
                R.apply_batch(tokens_of, msg.data)
        return list(live.values())

    async def lookup(self, req_id: str) -> journal_pb2.JournalRecord | None:
        """`req_id`'s finished record, else its accepted record on any daemon; None when the
        journal holds neither. A takeover's tombstones name the adopter (`Kvsched-Adopted-By`),
        followed here. A refused record's tombstone (`Kvsched-Refused`) is no record: the
        request's record on another daemon, if any (accepted there before this tombstone
        landed), else None. A tombstone that names nobody, with no finished record, is a record
        changing hands: Unavailable, retry."""
        done = await self.last(R.done_subject(req_id))
        if done is not None and done.data:
            return R.parse_record(done.data)
        msg = await self.last(R.req_subject("*", req_id))
        for _ in range(4):
            if msg is None:
                return None
            if msg.data:
                return R.parse_record(msg.data)
            headers = msg.headers or {}
            if headers.get(R.REFUSED):
                return await self._accepted_anywhere(req_id)
            adopter = headers.get(R.ADOPTED_BY)
            if not adopter:
                break
            msg = await self.last(R.req_subject(adopter, req_id))
        raise Unavailable(f"request {req_id!r} is changing owner in the journal; retry")

    async def _accepted_anywhere(self, req_id: str) -> journal_pb2.JournalRecord | None:
        """`req_id`'s accepted record under any daemon's subject (the last of each), or None
        (the newest when several daemons hold one)."""
        latest = None
        for msg in await self.read(R.req_subject("*", req_id), DeliverPolicy.LAST_PER_SUBJECT):
            if msg.data and (latest is None or msg.metadata.sequence.stream > latest[0]):
                latest = (msg.metadata.sequence.stream, msg.data)
        return None if latest is None else R.parse_record(latest[1])

    async def last(self, subject: str) -> Any:
        """The stream's last message on `subject` (None: none); Unavailable when NATS fails."""
        from nats.js.errors import NotFoundError

        try:
            return await self.js.get_last_msg(R.STREAM, subject)
        except NotFoundError:
            return None
        except Exception as exc:
            raise Unavailable(f"the request journal cannot be read now ({exc}); retry") from None

    async def last_headers(self, subject: str) -> dict[str, str]:
        """The headers of the last message on `subject` ({}: none, or NATS failed)."""
        try:
            msg = await self.last(subject)
        except Unavailable:
            return {}
        return dict(msg.headers or {}) if msg is not None else {}
