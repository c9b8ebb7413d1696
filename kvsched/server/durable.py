"""Durable requests: the request table's entry and exit through the journal.

    submit()    queue the request on its instance at once, then wait until the journal stores
                its accepted record before the client is told `queued`; a record that
                cannot be stored aborts the request and refuses it with UNAVAILABLE
    recover()   at start, before serving: this daemon's unfinished requests from the journal,
                parked (no client yet) as requests waiting for an instance, their recorded
                tokens kept (recomputed with the prompt; the output continues after them)
    resume()    a client takes a request's outputs over: a live request gets the caller's
                sink; a finished one is answered from the journal's finished record

Without a journal `submit` is the table's and `resume` serves live (detachable or recovered)
requests of this daemon only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvsched import codec
from kvsched.core import FinishReason, InvalidRequest, RequestNotFound, Role, Unavailable
from kvsched.server.engine import InstanceEngine
from kvsched.server.errors import PermissionDenied
from kvsched.server.request_table import RequestTable, Sink, Tracked
from kvsched.v1 import journal_pb2, request_service_pb2

if TYPE_CHECKING:
    from collections.abc import Mapping

log = logging.getLogger("kvsched.daemon")


class Journal(Protocol):
    """What the server asks of the request journal: `kvsched.durability.journal.Journal`, which
    the composition root (`kvsched.daemon`) opens and hands in (`Durability.use`); the server
    imports nothing of kvsched.durability."""

    async def accept(
        self, tr: Any, pb: request_service_pb2.GenerateRequest, instance: str
    ) -> None: ...

    async def recover(self) -> list[Any]: ...

    async def adopt(self, dead_id: str) -> list[Any]: ...

    async def lookup(self, req_id: str) -> journal_pb2.JournalRecord | None: ...

    @staticmethod
    def output_tokens(rec: journal_pb2.JournalRecord) -> list[int]: ...


@dataclass
class Done:
    """A finished request as its journal record tells it (Resume after the finish)."""

    finished: request_service_pb2.Finished
    tokens: list[int]


class OwnedElsewhere(Unavailable):
    """Resume of a request whose unfinished journal record names another daemon (a cluster
    relays the Resume there; alone, the client sees UNAVAILABLE with this message)."""

    def __init__(self, message: str, daemon_id: str) -> None:
        super().__init__(message)
        self.daemon_id = daemon_id


class ParkedSink:
    """The sink of a recovered request until its client resumes: outputs stay in the request."""

    def notify(self, tr: Tracked, /) -> None:
        pass

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        pass


class Nowhere:
    """The engine of a recovered request not yet placed on an instance."""

    instance_id = ""
    role = Role.MIXED
    ready = False
    queueing = False

    def holds(self, req: Any) -> bool:
        return False

    def sinks_changed(self) -> None:
        pass


NOWHERE = cast("InstanceEngine", Nowhere())


class Durability:
    def __init__(self, table: RequestTable, journal: Journal | None = None) -> None:
        self.table = table
        self.journal = journal
        table.journal = journal
        self.num_recovered = 0

    def use(self, journal: Journal) -> None:
        """Journal every request accepted from now on (set before serving)."""
        self.journal = self.table.journal = journal

    async def submit(
        self,
        pb: request_service_pb2.GenerateRequest,
        sink: Sink,
        owner: str = "",
        client_tag: str = "",
        carrier: Mapping[str, str] | None = None,
        deadline_s: float | None = None,
    ) -> Tracked:
        """Accept one request: queued on its instance at once (the GPU does not wait for the
        journal), returned once its accepted record is stored (`confirm`)."""
        tr = self.table.submit(pb, sink, owner, client_tag, carrier, deadline_s)
        # A request forwarded to a peer's instance is journaled by that peer, its owner (the
        # forwarded call comes through this same path there), never twice.
        if self.journals(tr):
            await self.confirm(tr, pb)
        return tr

    def journals(self, tr: Tracked) -> bool:
        """Whether this daemon journals `tr`: with a journal, when it runs here (not on a
        peer's instance, whose daemon journals it)."""
        return self.journal is not None and isinstance(tr.engine, InstanceEngine)

    async def confirm(self, tr: Tracked, pb: request_service_pb2.GenerateRequest) -> None:
        """Wait until the journal stores `tr`'s accepted record. Refused (`Unavailable`): the
        request is aborted and its client must be told the error, not `queued` (its sink
        holds its outputs until this returns)."""
        assert self.journal is not None
        try:
            await self.journal.accept(tr, pb, tr.engine.instance_id)
        except Unavailable:
            if not tr.finished:
                self.table.abort_tracked(tr, "refused: the journal did not store the request")
            raise

    async def recover(self, dead_id: str = "") -> int:
        """Park this daemon's unfinished requests from the journal (with `dead_id`: take over
        that daemon's, `Journal.adopt`); returns how many."""
        if self.journal is None:
            return 0
        table = self.table
        now = time.monotonic()
        deadline = now + max(table.config.requeue_timeout_s, 1.0)
        found = await (self.journal.adopt(dead_id) if dead_id else self.journal.recover())
        for u in found:
            rec = u.record
            mine = table.tracked.get(rec.request_id)
            if mine is not None:  # accepted here, forwarded to the dead daemon's instance
                self._continue_here(mine, dead_id)
                continue
            req = codec.request_from_proto(
                rec.request, rec.request_id, now, table.config.default_max_tokens
            )
            req.output_token_ids = list(u.tokens)
            tr = Tracked(
                req, NOWHERE, ParkedSink(), rec.request.detachable, rec.principal, rec.client_tag
            )
            tr.model = rec.request.model
            # Taken over: its tokens are journaled anew under this daemon at the next flush.
            tr.durable, tr.journaled = 2, 0 if dead_id else len(u.tokens)
            req.tag = tr
            table.tracked[req.req_id] = tr
            table.all_done.clear()
            self.num_recovered += 1
            if len(req.output_token_ids) >= req.sampling.max_tokens:
                table._fail(tr, "", FinishReason.LENGTH)  # it had finished: its record was lost
                continue
            table.orphans.append((tr, deadline, "recovered from the journal after a restart"))
        if found:
            whose = f"daemon {dead_id}'s" if dead_id else "the"
            log.info("recovered %d unfinished request(s) from %s journal", len(found), whose)
        return len(found)

    def _continue_here(self, tr: Tracked, dead_id: str) -> None:
        """A request this daemon accepted and forwarded to `dead_id`'s instance, whose record
        this daemon just adopted: its client still streams from here, so it is recomputed
        here (prompt + the tokens relayed so far), journaled under this daemon from now on."""
        if tr.finished:
            return
        tr.durable, tr.journaled = 2, 0
        if tr.forward is None:
            return  # its forwarder already recomputes it here: journaled here from now on
        task, tr.forward = tr.forward, None
        if task is not None:
            task.cancel()  # the forwarder's attempt to follow it elsewhere
        self.num_recovered += 1
        req = tr.req
        if len(req.output_token_ids) >= req.sampling.max_tokens:
            self.table._fail(tr, "", FinishReason.LENGTH)
            return
        self.table.requeue_lost(req, f"its instance's daemon {dead_id} died; adopted here")

    async def resume(
        self, pb: request_service_pb2.RequestServiceResumeRequest, owner: str, sink: Sink
    ) -> Tracked | Done:
        """Hand request `pb.request_id`'s outputs past the caller's tokens to `sink`: its
        Tracked (now streaming to `sink`, `sent` = the caller's count), or the journal's
        finished record. Typed errors: see RequestService.Resume in request_service.proto."""
        rid = pb.request_id
        held = list(pb.token_ids)
        have = len(held) if held else pb.num_tokens_received
        tr = self.table.tracked.get(rid)
        if tr is None:
            return await self._finished(rid, owner, held, have)
        if tr.owner and tr.owner != owner:
            raise PermissionDenied(f"request {rid!r} was submitted with other credentials")
        req = tr.req
        out = req.output_token_ids
        _check_prefix(rid, held, out)
        if len(held) > len(out) and not tr.engine.holds(req):
            # Not placed yet (recovered, or its instance was lost): the client's tokens win.
            out.extend(held[len(out) :])
            if len(out) >= req.sampling.max_tokens:
                self.table._fail(tr, "", FinishReason.LENGTH)
        old = tr.sink
        tr.sink, tr.sent = sink, have
        tr.engine.sinks_changed()
        old.notify(tr)  # its stream sees it lost the request and ends
        if len(out) > have or tr.finished:
            sink.notify(tr)
        return tr

    async def _finished(self, rid: str, owner: str, held: list[int], have: int) -> Done:
        rec = await self.journal.lookup(rid) if self.journal is not None else None
        if rec is None:
            if rid in self.table.recent:
                raise RequestNotFound(
                    f"request {rid!r} has finished and this daemon keeps no outputs of finished "
                    "requests (no journal: run with --cluster)"
                )
            raise RequestNotFound(
                f"no request {rid!r} (never accepted, or finished longer ago than the journal "
                "keeps records)"
            )
        if rec.principal and rec.principal != owner:
            raise PermissionDenied(f"request {rid!r} was submitted with other credentials")
        if rec.kind != journal_pb2.JournalRecord.KIND_FINISHED:
            raise OwnedElsewhere(
                f"request {rid!r} belongs to daemon {rec.daemon_id!r}; resume it there",
                rec.daemon_id,
            )
        assert self.journal is not None  # (a record came from it)
        out = self.journal.output_tokens(rec)
        if have > len(out):
            raise InvalidRequest(
                f"request {rid!r} finished with {len(out)} output tokens; the client claims {have}"
            )
        _check_prefix(rid, held, out)
        return Done(rec.finished, out)


def _check_prefix(rid: str, held: list[int], out: list[int]) -> None:
    n = min(len(held), len(out))
    if held[:n] != out[:n]:
        raise InvalidRequest(
            f"the tokens sent for request {rid!r} differ from its recorded output "
            f"(first difference at position {next(i for i in range(n) if held[i] != out[i])})"
        )
