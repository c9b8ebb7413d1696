"""The journal: every accepted request of this daemon, durable in a JetStream stream.

    accept()     the accepted record, published and acknowledged (awaited) before the client
                 is told `queued`; refused with `Unavailable` when it cannot be stored
    run()        every flush_ms: the live requests' new output tokens, one TokenBatch message
                 (compacted from position 0 when the deltas outgrow the live tokens, and after
                 a NATS reconnect); the writer publishes what is queued, in order
    progress()   one request's tokens now (its instance was lost, or it was handed off)
    finished()   the finished record (`done.<id>`) and the accepted record's expiring
                 tombstone, in order, off the caller's path
    recover()    the unfinished requests this daemon owns, with their recorded tokens
    adopt()      a dead (or handing-over) daemon's unfinished requests, taken over by CAS
    lookup()     a request's finished record, or its accepted one on any daemon (Resume)

What recover(), adopt() and lookup() read back from the stream, `JournalReader` reads
(reads.py); the journal itself writes.

Subjects, records and retention: journal.proto (records.py encodes them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from kvsched.codec import finished_to_proto
from kvsched.core import Request, Unavailable
from kvsched.core.errors import AdoptIncomplete
from kvsched.core.journal_state import JournalState
from kvsched.durability import records as R
from kvsched.durability.acks import AckedPublisher
from kvsched.durability.reads import JournalReader
from kvsched.v1 import journal_pb2, request_service_pb2

log = logging.getLogger("kvsched.journal")

PURGE: dict[str, str] = {}  # an outbox entry with these headers purges its subject
_STORED = JournalState.STORED
ADOPT_CONCURRENCY = 16  # requests of a takeover whose records move at once (Journal.adopt)


class Journaled(Protocol):
    """What the journal reads of a tracked request (the daemon's `Tracked`)."""

    req: Request
    owner: str
    client_tag: str
    finished: bool
    journal_state: JournalState  # written here only
    journaled: int  # output tokens recorded (written here only)


class Journal:
    @staticmethod
    def output_tokens(rec: journal_pb2.JournalRecord) -> list[int]:
        """A finished record's output tokens (what the server's `Journal` port reads)."""
        return R.finished_tokens(rec)

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
        self.tok_subject = R.tok_subject(self.daemon_id)
        self.flush_s = flush_ms / 1000.0
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.acks = AckedPublisher(self.nc, timeout_s)
        self.reads = JournalReader(self.js, timeout_s)
        self._outbox: asyncio.Queue[tuple[str, bytes, dict[str, str] | None]] = asyncio.Queue()
        self._reconnects = 0
        self._since_compaction = 0  # tokens written to tok.<daemon> since its last compaction
        self.num_accepted = 0
        self.num_refused = 0
        self.num_compactions = 0
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
            allow_msg_ttl=True,
        )
        try:
            await self.js.add_stream(cfg)
        except Exception:
            await self.js.update_stream(cfg)
        self._reconnects = self.nc.stats.get("reconnects", 0)
        await self.acks.open()

    # ---- writing ------------------------------------------------------------------------------
    async def accept(
        self, tr: Journaled, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> None:
        """Store the accepted record; `Unavailable` when NATS does not acknowledge it in time."""
        await self.begin_accept(tr, pb, instance)

    def begin_accept(
        self, tr: Journaled, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> asyncio.Future[None]:
        """Publish the accepted record (pipelined with concurrent accepts: `acks`); the future
        ends when it is stored (None) or refused (`Unavailable`). `tr`'s journal state is
        settled when the acknowledgement comes, whether or not anyone still awaits it."""
        req_id = tr.req.req_id
        data = R.accepted_record(pb, req_id, self.daemon_id, instance, tr.owner, tr.client_tag)
        subject = R.req_subject(self.daemon_id, req_id)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.nc.is_connected:  # refuse at once: a buffered record could land later
            self._settle(tr, subject, ConnectionError("not connected"), 0.0, done)
            return done
        tr.journal_state = JournalState.IN_FLIGHT
        t0 = time.monotonic()
        self.acks.publish(
            subject,
            data,
            then=lambda exc: self._settle(tr, subject, exc, time.monotonic() - t0, done),
        )
        return done

    def _settle(
        self,
        tr: Journaled,
        subject: str,
        exc: BaseException | None,
        elapsed: float,
        done: asyncio.Future[None],
    ) -> None:
        if exc is None:
            tr.journal_state = JournalState.STORED
            self.num_accepted += 1
            if tr.finished:  # it finished while its record was in flight
                self.finished(tr)
            if not done.done():  # (cancelled: `accept`'s caller went away)
                done.set_result(None)
            return
        if tr.journal_state == JournalState.IN_FLIGHT:
            # It may still be stored (sent, then the link broke before the ack, its bytes
            # delivered later): an expiring tombstone follows it on the same subject, so that
            # a refused request leaves nothing behind. Not a purge: JetStream orders a
            # subject's messages on one connection, not a message and a later API request
            # (a purge could run before the record it should remove is stored).
            self._emit(subject, b"", R.REFUSED_HEADERS)
        tr.journal_state = JournalState.NONE
        self.num_refused += 1
        if not done.done():
            done.set_exception(Unavailable(self._refusal(exc, elapsed)))

    def _refusal(self, exc: BaseException, elapsed: float) -> str:
        """Why a record was not stored, as it happened: the link was down (refused at once),
        no acknowledgement within journal_timeout_s, or another failure after `elapsed`."""
        where = f"the request journal (NATS JetStream at {self.link.url})"
        if isinstance(exc, ConnectionError):
            cause = getattr(self.link, "last_error", "") or "connection lost"
            return (
                f"{where} is unreachable: this daemon's NATS connection is down ({cause}); "
                "nothing was accepted: retry (on another daemon of the cluster), or check NATS"
            )
        if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower():
            return (
                f"{where} did not acknowledge the request within {self.timeout_s:g} s "
                "(journal_timeout_s); nothing was accepted: retry, or check NATS"
            )
        return (
            f"{where} failed to store the request after {elapsed:.2f} s "
            f"({type(exc).__name__}: {exc}); nothing was accepted: retry, or check NATS"
        )

    def _emit(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self._outbox.put_nowait((subject, data, headers))

    def progress(self, tr: Journaled) -> None:
        """Record `tr`'s new output tokens now (written off the caller's path)."""
        out = tr.req.output_token_ids
        n = len(out)
        if tr.journal_state == JournalState.STORED and n > tr.journaled:
            entry = (tr.req.req_id, tr.journaled, out[tr.journaled : n])
            tr.journaled = n
            self._since_compaction += len(entry[2])
            for data in R.token_batches([entry]):
                self._emit(self.tok_subject, data)

    def restored(self, tr: Journaled, recorded: int) -> None:
        """`tr` was recovered or adopted from a stored record: `recorded` of its output tokens
        are journaled under this daemon (0: all of them are written anew at the next flush)."""
        tr.journal_state = JournalState.STORED
        tr.journaled = recorded

    def adopted_elsewhere(self, tr: Journaled) -> None:
        """`tr` was adopted by another daemon (its record names that daemon now): closed
        here without a record; the adopter journals it."""
        tr.journal_state = JournalState.CLOSED

    def moved_to(self, tr: Journaled, daemon_id: str) -> None:
        """`tr`, stored here, was accepted by daemon `daemon_id` (forwarded there after a peer
        refused it), which journals it now: its record here becomes a tombstone naming that
        daemon (`lookup` follows it), closed here."""
        if tr.journal_state != JournalState.STORED:
            return
        tr.journal_state = JournalState.CLOSED
        headers = {**R.TOMBSTONE_HEADERS, R.ADOPTED_BY: daemon_id}
        self._emit(R.req_subject(self.daemon_id, tr.req.req_id), b"", headers)

    def finished(self, tr: Journaled) -> None:
        """Record `tr`'s end (its one Finished is decided); the tokens go with it."""
        if tr.journal_state != JournalState.STORED:
            return  # not stored yet: accept() calls again once it is; or never journaled
        req = tr.req
        data = R.finished_record(
            req.req_id, self.daemon_id, tr.owner, list(req.output_token_ids), finished_to_proto(req)
        )
        tr.journal_state = JournalState.CLOSED
        self._emit(R.done_subject(req.req_id), data)
        self._emit(R.req_subject(self.daemon_id, req.req_id), b"", R.TOMBSTONE_HEADERS)

    def flush(self, live: Iterable[Journaled], compact: bool = False) -> None:
        """Queue the live requests' new tokens as one TokenBatch; all their tokens, from
        position 0 and rolling the subject up, when `compact` or when the tokens written since
        the last compaction exceed the live ones."""
        entries = []
        trs = []
        live_tokens = 0
        for tr in live:
            if tr.journal_state is not _STORED:
                continue
            trs.append(tr)
            out = tr.req.output_token_ids
            n = len(out)
            live_tokens += n
            if n > tr.journaled:
                entries.append((tr.req.req_id, tr.journaled, out[tr.journaled : n]))
                tr.journaled = n
                self._since_compaction += len(entries[-1][2])
        if compact or self._since_compaction > max(live_tokens, 4096):
            entries = [(tr.req.req_id, 0, list(tr.req.output_token_ids)) for tr in trs]
            batches = R.token_batches(entries) or [R.token_batches([("", 0, [])])[0]]
            self._emit(self.tok_subject, batches[0], R.ROLLUP)
            for data in batches[1:]:
                self._emit(self.tok_subject, data)
            self._since_compaction = 0
            self.num_compactions += 1
            return
        for data in R.token_batches(entries):
            self._emit(self.tok_subject, data)

    async def run(self, live: Callable[[], Iterable[Journaled]]) -> None:
        """Every flush_ms, the live requests' new tokens (all of them, compacted, after a NATS
        reconnect); the writer publishes what is queued, in order."""
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            while True:
                await asyncio.sleep(self.flush_s)
                reconnects = self.nc.stats.get("reconnects", 0)
                compact = reconnects != self._reconnects
                self._reconnects = reconnects
                self.flush(live(), compact)
        finally:
            writer.cancel()

    async def _write(self) -> None:
        """Publish queued records in order (core publishes: the stream stores them; a loss is
        repaired by the next compaction); purges (API requests: a takeover's, of the dead
        daemon's token deltas) are sent after the records before them."""
        box = self._outbox
        while True:
            items = [await box.get()]
            while not box.empty():
                items.append(box.get_nowait())
            try:
                await self._publish_all(items)
            finally:
                for _ in items:
                    box.task_done()

    async def _publish_all(self, items: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
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
                log.debug("purging a taken-over daemon's token deltas failed: %s", r)

    async def close(self, live: Iterable[Journaled], timeout_s: float = 5.0) -> None:
        """At shutdown, before the NATS link closes: the live requests' last tokens and every
        queued record (finished records of a drain) handed to NATS (run() still running)."""
        self.flush(live)
        try:
            await asyncio.wait_for(self._outbox.join(), timeout_s)
        except TimeoutError:
            log.warning("journal: %d record(s) not written at shutdown", self._outbox.qsize())

    # ---- recovery, takeover, lookups (the reads are JournalReader's: reads.py) -------------------
    async def recover(self, daemon_id: str | None = None) -> list[R.Unfinished]:
        """The accepted, unfinished requests of this daemon (or of `daemon_id`: the seam of a
        takeover of a dead peer's journal), with their recorded tokens."""
        return await self.reads.unfinished(daemon_id or self.daemon_id)

    async def adopt(self, dead_id: str, only: str = "") -> list[R.Unfinished]:
        """Take over daemon `dead_id`'s unfinished requests: for each, its accepted record is
        stored under this daemon, then the dead daemon's record is replaced by a tombstone
        published only if that record is still the subject's last (JetStream's
        expected-last-subject-sequence: a compare-and-set). Exactly one daemon wins each
        request; a loser withdraws its copy. A crash between the two steps leaves the request
        with two owners, never with none. Returns the requests won, in the order read. `only`:
        that request alone (its live owner hands it over: `kvsched.cluster.forward`), the
        owner's others and their tokens left as they are.

        Requests are taken ADOPT_CONCURRENCY at a time (each one's steps in order): their
        clients wait for the whole pass (a loaded host took 2 s for 69 requests one by one).
        A NATS failure on some raises `AdoptIncomplete` with those won (the caller keeps them;
        the others keep their record under `dead_id`, for the next pass)."""
        todo = [u for u in await self.recover(dead_id) if not only or u.record.request_id == only]
        gate = asyncio.Semaphore(ADOPT_CONCURRENCY)

        async def one(u: R.Unfinished) -> R.Unfinished | None:
            async with gate:
                return await self._adopt_one(dead_id, u)

        got = await asyncio.gather(*(one(u) for u in todo), return_exceptions=True)
        won = [u for u in got if isinstance(u, R.Unfinished)]
        failed = [e for e in got if isinstance(e, BaseException)]
        if failed:  # the dead daemon's token deltas stay: the next pass reads them
            raise AdoptIncomplete(won, failed[0])
        if won and not only:
            self._emit(R.tok_subject(dead_id), b"", PURGE)  # its deltas now live in ours
        return won

    async def _adopt_one(self, dead_id: str, u: R.Unfinished) -> R.Unfinished | None:
        """One request of `adopt`: the request when won, None when another daemon won it."""
        rec = u.record
        rid = rec.request_id
        rec.daemon_id = self.daemon_id
        mine = R.req_subject(self.daemon_id, rid)
        await self.js.publish(mine, rec.SerializeToString(), timeout=self.timeout_s)
        cas = {
            **R.TOMBSTONE_HEADERS,
            "Nats-Expected-Last-Subject-Sequence": str(u.seq),
            R.ADOPTED_BY: self.daemon_id,
        }
        try:
            await self.js.publish(
                R.req_subject(dead_id, rid), b"", timeout=self.timeout_s, headers=cas
            )
        except Exception as exc:  # another daemon took it first (or NATS failed): withdraw
            log.info("takeover of %s from %s not won: %s", rid, dead_id, exc)
            # The withdrawal names the winner (from its tombstone), for `lookup`.
            winner = await self.reads.last_headers(R.req_subject(dead_id, rid))
            headers = dict(R.TOMBSTONE_HEADERS)
            if winner.get(R.ADOPTED_BY):
                headers[R.ADOPTED_BY] = winner[R.ADOPTED_BY]
            self._emit(mine, b"", headers)
            return None
        # Stored again, now after the tombstone: a lookup of the request's last record
        # on any daemon (`lookup`) finds this one, not the tombstone, while that lives.
        try:
            await self.js.publish(
                mine, rec.SerializeToString(), timeout=self.timeout_s, headers=R.ROLLUP
            )
        except Exception as exc:  # won all the same: lookups see it once the tombstone ages
            log.warning("takeover of %s: second record not stored: %s", rid, exc)
        return u

    async def lookup(self, req_id: str) -> journal_pb2.JournalRecord | None:
        """`req_id`'s finished record, else its accepted record on any daemon (None: neither);
        Unavailable while it changes owner (`JournalReader.lookup`)."""
        return await self.reads.lookup(req_id)
