"""The ways back to a request: recovery from the journal and Resume.

    recover()   at start, before serving: this daemon's unfinished requests from the journal,
                parked (no client yet) as requests waiting for an instance, their recorded
                tokens kept (recomputed with the prompt; the output continues after them);
                with a dead daemon's id (a takeover), that daemon's: a request this daemon
                accepted and forwarded to it continues here (`_continue_here`)
    resume()    a client takes a request's outputs over: a live request's sink becomes the
                caller's (`RequestTable.redirect`); a finished one is answered from the
                journal's finished record

Without a journal, `resume` serves live (detachable) requests of this daemon only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvsched import codec
from kvsched.core import FinishReason, InvalidRequest, RequestNotFound, Unavailable
from kvsched.core.errors import AdoptIncomplete
from kvsched.core.slots import set_output
from kvsched.server.errors import PermissionDenied
from kvsched.server.requests.durable import Durability
from kvsched.server.requests.record import Parked, RemotePeer, Sink, Tracked
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import journal_pb2, request_service_pb2

log = logging.getLogger("kvsched.daemon")

RECOVERED = "recovered from the journal after a restart"


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

    wants_tokens = False

    def notify(self, tr: Tracked, /) -> None:
        pass

    def add_tokens(self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /) -> None:
        pass

    def attached(self) -> bool:
        return False  # no client reads it until one resumes


class Resumer:
    def __init__(self, table: RequestTable, durable: Durability) -> None:
        self.table = table
        self.durable = durable
        self.num_recovered = 0

    async def recover(self, dead_id: str = "", only: str = "") -> int:
        """Park this daemon's unfinished requests from the journal (with `dead_id`: take over
        that daemon's, `Journal.adopt`; with `only`, that one request, which its live owner
        hands over, or, without `dead_id`, this daemon's own record of it when this daemon
        does not track it); returns how many."""
        journal = self.durable.journal
        if journal is None:
            return 0
        table = self.table
        now = time.monotonic()
        deadline = now + max(table.config.requeue_timeout_s, 1.0)
        incomplete: AdoptIncomplete | None = None
        try:
            found = await (journal.adopt(dead_id, only) if dead_id else journal.recover())
        except AdoptIncomplete as exc:  # those won are parked here; raised after (retried)
            found, incomplete = exc.won, exc
        if only and not dead_id:  # one of this daemon's own records, that it does not run
            found = [u for u in found if u.record.request_id == only]
        for u in found:
            rec = u.record
            mine = table.tracked.get(rec.request_id)
            if mine is not None:  # accepted here, forwarded to the dead daemon's instance
                if dead_id:  # (an own record of a request tracked here: live, left alone)
                    self._continue_here(mine, dead_id)
                continue
            req = codec.request_from_proto(
                rec.request, rec.request_id, now, table.config.default_max_tokens
            )
            set_output(req, list(u.tokens))
            tr = Tracked(
                req,
                Parked(deadline, RECOVERED),
                ParkedSink(),
                rec.request.detachable,
                rec.principal,
                rec.client_tag,
                model=rec.request.model,
            )
            # Taken over: its tokens are journaled anew under this daemon at the next flush.
            journal.restored(tr, 0 if dead_id else len(u.tokens))
            self.num_recovered += 1
            table.track_parked(tr)
        if found:
            whose = f"daemon {dead_id}'s" if dead_id else "the"
            log.info("recovered %d unfinished request(s) from %s journal", len(found), whose)
        if incomplete is not None:
            raise incomplete.cause
        return len(found)

    def _continue_here(self, tr: Tracked, dead_id: str) -> None:
        """A request this daemon accepted and forwarded to `dead_id`'s instance, whose record
        this daemon just adopted: its client still streams from here, so it is recomputed
        here (prompt + the tokens relayed so far), journaled under this daemon from now on."""
        if tr.finished:
            return
        assert self.durable.journal is not None
        self.durable.journal.restored(tr, 0)
        loc = tr.location
        if type(loc) is not RemotePeer or loc.relay is None:
            return  # its forwarder already recomputes it here: journaled here from now on
        self.table.relay_ended(tr)
        loc.relay.cancel()  # the forwarder's attempt to follow it elsewhere
        self.num_recovered += 1
        req = tr.req
        if len(req.output_token_ids) >= req.sampling.max_tokens:
            self.table.finish(tr, FinishReason.LENGTH, "")
            return
        self.table.requeue_lost(req, f"its instance's daemon {dead_id} died; adopted here")

    async def resume(
        self, pb: request_service_pb2.RequestServiceResumeRequest, owner: str, sink: Sink
    ) -> Tracked | Done:
        """Hand request `pb.request_id`'s outputs past the caller's tokens to `sink` (which
        starts past the caller's count): its record (now streaming to `sink`), or the journal's
        finished record. Typed errors: see RequestService.Resume in request_service.proto."""
        rid = pb.request_id
        held = list(pb.token_ids)
        have = len(held) if held else pb.num_tokens_received
        tr = self.table.tracked.get(rid)
        if tr is None:
            return await self._finished(rid, owner, held, have)
        if tr.owner and tr.owner != owner:
            raise PermissionDenied(f"request {rid!r} was submitted with other credentials")
        write = self.durable.in_flight(tr)
        if write is not None:
            # Not accepted yet: its accepted record is in flight to the journal (its Generate
            # has not been told `queued`). Only a stored request is resumed: a client attached
            # before would read a request that a refused write then aborts. Refused, it was
            # never accepted: NOT_FOUND, as for no record (the client submits it again).
            try:
                await asyncio.shield(write)
            except Unavailable as exc:
                raise RequestNotFound(
                    f"request {rid!r} was not accepted (its journal write was refused: {exc})"
                ) from None
            if self.table.tracked.get(rid) is not tr:  # finished meanwhile
                return await self._finished(rid, owner, held, have)
        req = tr.req
        out = req.output_token_ids
        _check_prefix(rid, held, out)
        if len(held) > len(out) and not tr.on_engine():
            # Not placed yet (recovered, or its instance was lost): the client's tokens win.
            out.extend(held[len(out) :])
            if len(out) >= req.sampling.max_tokens:
                self.table.finish(tr, FinishReason.LENGTH, "")
        old = self.table.redirect(tr, sink)
        old.notify(tr)  # its stream sees it lost the request and ends
        if len(out) > have or tr.finished:
            sink.notify(tr)
        return tr

    async def _finished(self, rid: str, owner: str, held: list[int], have: int) -> Done:
        rec = await journal.lookup(rid) if (journal := self.durable.journal) is not None else None
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
        assert journal is not None  # (a record came from it)
        out = journal.output_tokens(rec)
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
