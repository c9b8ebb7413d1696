"""The journal glue: the request table's requests, recorded by the journal.

`Durability` is a lifecycle observer of the request table (subscribed by `use`, when the
composition root opens the journal): a moved or handed-off request's tokens are recorded at
once (`progress`), a finished one gets its finished record (`finished`). `confirm` waits until
the journal stores a new request's accepted record (server/requests/accept.py calls it before the
client is told `queued`; a record that cannot be stored aborts the request and refuses it with
UNAVAILABLE). Recovery and Resume are server/requests/resume.py's.

The journal writes the record's `journal_state` and `journaled` (its only writer); the server
imports nothing of kvsched.durability: `Journal` below is the port it is handed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kvsched.core import Unavailable
from kvsched.core.journal_state import JournalState
from kvsched.server.requests.record import LocalEngine, Tracked
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import journal_pb2, request_service_pb2

log = logging.getLogger("kvsched.daemon")


class Journal(Protocol):
    """What the server asks of the request journal: `kvsched.durability.journal.Journal`, which
    the composition root (`kvsched.daemon`) opens and hands in (`Durability.use`); the server
    imports nothing of kvsched.durability."""

    async def accept(
        self, tr: Tracked, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> None: ...

    def begin_accept(
        self, tr: Tracked, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> asyncio.Future[None]: ...

    async def recover(self) -> list[Any]: ...

    async def adopt(self, dead_id: str, only: str = "") -> list[Any]: ...

    async def lookup(self, req_id: str) -> journal_pb2.JournalRecord | None: ...

    def progress(self, tr: Tracked) -> None: ...

    def finished(self, tr: Tracked) -> None: ...

    def restored(self, tr: Tracked, recorded: int) -> None: ...

    def adopted_elsewhere(self, tr: Tracked) -> None: ...

    def moved_to(self, tr: Tracked, daemon_id: str) -> None: ...

    @staticmethod
    def output_tokens(rec: journal_pb2.JournalRecord) -> list[int]: ...

    async def close(self, live: Iterable[Tracked], timeout_s: float = 5.0) -> None: ...


class Durability:
    """The journal glue (a `Lifecycle` observer of the table once `use` hands it a journal)."""

    def __init__(self, table: RequestTable, journal: Journal | None = None) -> None:
        self.table = table
        self.journal: Journal | None = None
        # Accepted records in flight to the journal, by request id (`in_flight`: Resume waits).
        self._writes: dict[str, asyncio.Future[None]] = {}
        if journal is not None:
            self.use(journal)

    def use(self, journal: Journal) -> None:
        """Journal every request accepted from now on (set before serving)."""
        self.journal = journal
        self.table.observers.observe(self)

    def journals(self, tr: Tracked) -> bool:
        """Whether this daemon journals `tr`: with a journal, when it runs here (not on a
        peer's instance, whose daemon journals it)."""
        return self.journal is not None and type(tr.location) is LocalEngine

    async def confirm(self, tr: Tracked, pb: request_service_pb2.GenerateRequest) -> None:
        """Wait until the journal stores `tr`'s accepted record. Refused (`Unavailable`): the
        request is aborted and its client must be told the error, not `queued` (its sink
        holds its outputs until this returns)."""
        assert self.journal is not None
        # A future, not a task: the journal settles the record's state in the acknowledgement's
        # callback, with or without this caller.
        write = self._begin(tr, pb)
        try:
            # Shielded: a caller that goes away (its deadline, a cancel) does not cancel the
            # write. A cancelled write could still land (its bytes were sent) as an accepted
            # record that nobody runs or closes; finished, it is stored (the request's end is
            # recorded after it) or refused (a tombstone follows it, the request aborted).
            await asyncio.shield(write)
        except asyncio.CancelledError:
            write.add_done_callback(lambda w: self._settled(tr, w))
            raise
        except Unavailable:
            self._refused(tr)
            raise

    def begin_confirm(
        self, tr: Tracked, pb: request_service_pb2.GenerateRequest
    ) -> asyncio.Future[None]:
        """`confirm` for a caller that does not wait (a Session submit): the write's future,
        its exception `Unavailable` when refused; a refused request is aborted before any
        callback the caller adds runs."""
        write = self._begin(tr, pb)
        write.add_done_callback(lambda w: self._settled(tr, w))
        return write

    def _begin(self, tr: Tracked, pb: request_service_pb2.GenerateRequest) -> asyncio.Future[None]:
        assert self.journal is not None
        write = self.journal.begin_accept(tr, pb, tr.instance_id)
        # Kept until its callbacks run, a write refused at once too: a Resume arriving before
        # the refusal's abort sees it (the abort callbacks come right after this one).
        rid = tr.req.req_id
        self._writes[rid] = write
        write.add_done_callback(
            lambda w: self._writes.pop(rid) if self._writes.get(rid) is w else None
        )
        return write

    def in_flight(self, tr: Tracked) -> asyncio.Future[None] | None:
        """The journal write of `tr`'s accepted record until it is settled (None after, or when
        none was begun here): it ends in None (stored) or raises `Unavailable` (refused: the
        request is aborted, it was never accepted)."""
        return self._writes.get(tr.req.req_id)

    def _settled(self, tr: Tracked, write: asyncio.Future[None]) -> None:
        """A write whose caller went away has ended: refused, its request is aborted."""
        if not write.cancelled() and isinstance(write.exception(), Unavailable):
            self._refused(tr)

    def _refused(self, tr: Tracked) -> None:
        if not tr.finished:
            self.table.abort_tracked(tr, "refused: the journal did not store the request")

    async def record_here(self, tr: Tracked, pb: request_service_pb2.GenerateRequest) -> bool:
        """A request this daemon accepted and forwarded comes back (its peer refused it before
        accepting it, or went away without journaling it): store its accepted record under
        this daemon now, wherever it waits or runs next, so that this daemon's death does not
        lose it. Retried (3 tries, 0.5 s apart); False when not stored (the journal is out of
        reach: it runs all the same, unjournaled, logged)."""
        journal = self.journal
        if journal is None or tr.finished:
            return False
        if tr.journal_state != JournalState.NONE:
            return tr.journal_state == JournalState.STORED
        why = ""
        for attempt in range(3):
            if attempt:
                await asyncio.sleep(0.5)
            if tr.finished:
                return False
            try:
                await journal.accept(tr, pb, tr.instance_id)
                return True
            except Unavailable as exc:
                why = str(exc)
        log.warning("request %s runs here unjournaled: %s", tr.req.req_id, why)
        return False

    def moved_to(self, tr: Tracked, daemon_id: str) -> None:
        """`tr`, recorded here by `record_here`, was accepted by daemon `daemon_id` since:
        that daemon journals it (the record here names it)."""
        if self.journal is not None:
            self.journal.moved_to(tr, daemon_id)

    # ---- Lifecycle ------------------------------------------------------------------------
    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        pass  # its accepted record is written by `confirm`, awaited by the accepting call

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        assert self.journal is not None
        self.journal.progress(tr)

    def request_progressed(self, tr: Tracked, /) -> None:
        assert self.journal is not None
        self.journal.progress(tr)

    def request_finished(self, tr: Tracked, /) -> None:
        assert self.journal is not None
        self.journal.finished(tr)
