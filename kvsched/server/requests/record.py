"""One request's daemon-side record (`Tracked`), its location, and the lifecycle protocol.

A `Tracked` is written by one owner per field (tests/test_layout.py checks it):

    req, location, sink, decode_engine, finished, out_at_place   server/requests/table.py
    journal_state, journaled                                    the journal (kvsched.durability)
    span                                                        server/telemetry/tracing.py
    losses                                                      server/requests/poison.py
    owner, client_tag, detachable, model                        set once, at construction

Its location is a tagged value: `LocalEngine` (an instance of this daemon holds or queues
it), `RemotePeer` (a peer's instance runs it; `relay` is the task relaying its outputs) or
`Parked` (no instance holds it: its instance was lost, or it was recovered from the journal;
it is placed again before `deadline`, or fails with `reason`).

`Lifecycle` is what the request table tells its observers (telemetry, the journal glue, the
cluster's forwarder): accepted, moved (it lost its instance and is parked), progressed (its
tokens should be recorded now: handed off, or moved), finished (its one Finished is decided).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvsched.core import Request, lifecycle
from kvsched.core.journal_state import JournalState
from kvsched.core.slots import set_output

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping

    from kvsched.server.instances.engine import InstanceEngine
from collections.abc import Mapping


class Sink(Protocol):
    """Where a request's outputs go. `notify`: it has news (it finished: `Tracked.finished`).
    `attached`: a client reads it now. `add_tokens`: new output tokens of several requests, in order, each request at most once:
    trs[i] produced counts[i] tokens (counts None: one each), consecutive in toks. The same
    tokens are already in each request's `output_token_ids`: a sink may take them from the
    call (a Session joins the deltas) or take the call as news and read its requests (a
    Generate stream sends `output_token_ids` past what it sent). `wants_tokens` False: the
    sink takes the call as news only, and `toks` may be empty (the engine's delivery then
    builds no list of them)."""

    wants_tokens: bool

    def notify(self, tr: Tracked, /) -> None: ...

    def add_tokens(
        self, trs: list[Tracked], counts: list[int] | None, toks: list[int], /
    ) -> None: ...

    def attached(self) -> bool:
        """A client reads this sink now (its stream is open): False once that stream ended
        (its client went away or gave up waiting) and for a sink no client reads."""
        ...


class PeerInstance(Protocol):
    """A peer's instance as the record names it (kvsched.cluster.routing.RemoteInstance)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def daemon_id(self) -> str: ...

    @property
    def address(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """An instance of this daemon holds (or queues) the request."""

    engine: InstanceEngine


@dataclass(frozen=True, slots=True)
class RemotePeer:
    """A peer's instance runs it; `relay` relays its outputs here (None once it ended)."""

    instance: PeerInstance
    relay: asyncio.Task[None] | None = None


@dataclass(frozen=True, slots=True)
class Parked:
    """No instance holds it: placed again before `deadline` (monotonic s) or failed with
    `reason`."""

    deadline: float
    reason: str


Location = LocalEngine | RemotePeer | Parked


def fresh_copy(old: Request) -> Request:
    """A new core request with `old`'s identity, outputs and timings, to be placed anew (the
    old one stays with the scheduler that held it: its end is then ignored). No
    ttft_deadline_ms: an accepted request is never shed when it moves (its implicit deadline
    from its first arrival keeps its place among the moved ones). Its prefix hit is counted
    anew where it is placed next."""
    new = Request(
        old.req_id,
        old.prompt_token_ids,
        old.sampling,
        old.priority,
        old.arrival_time,
        old.lora_name,
        old.cache_salt,
        old.mm_ranges,
        tenant=old.tenant,
    )
    set_output(new, old.output_token_ids)
    lifecycle.carry_over(old, new)
    new.tag = old.tag
    return new


@dataclass(slots=True, eq=False)
class Tracked:
    req: Request  # the current core request (a decode instance's copy after hand-off)
    location: Location
    sink: Sink
    detachable: bool = False
    owner: str = ""
    client_tag: str = ""
    decode_engine: InstanceEngine | None = None  # P/D: holds a reservation until hand-off
    span: Any = None  # server/telemetry/tracing.py's
    finished: bool = False  # its one Finished is decided: the table no longer tracks it
    journal_state: JournalState = JournalState.NONE
    journaled: int = 0  # output tokens the journal has recorded
    model: str = ""  # the model it runs on (a lost instance's request moves within it)
    losses: int = 0  # instance losses it is a suspect of (server/requests/poison.py)
    out_at_place: int = 0  # output tokens it had when last placed
    # P/D across daemons: its GenerateRequest, kept while its prefill instance here runs it
    # and its decode instance is to be a peer's (handed over with the prefilled tokens)
    pd_msg: Any = None

    @property
    def engine(self) -> InstanceEngine | None:
        """The local engine holding or queueing it (None: on a peer, or parked)."""
        loc = self.location
        return loc.engine if type(loc) is LocalEngine else None

    @property
    def instance_id(self) -> str:
        """The instance it runs on ("" while parked)."""
        loc = self.location
        if type(loc) is LocalEngine:
            return loc.engine.instance_id
        if type(loc) is RemotePeer:
            return loc.instance.instance_id
        return ""

    def on_engine(self) -> bool:
        """Whether a local engine's scheduler holds it now."""
        loc = self.location
        return type(loc) is LocalEngine and loc.engine.holds(self.req)


class Lifecycle(Protocol):
    """A lifecycle observer (`RequestTable.observers.observe`): telemetry (server/telemetry/hooks.py), the
    journal glue (server/requests/durable.py) and a cluster's forwarder implement it. Hooks run
    synchronously on the event loop, on lifecycle events only (never per token)."""

    def request_accepted(self, tr: Tracked, carrier: Mapping[str, str], /) -> None:
        """Validated and queued (locally or on a peer). `carrier`: the caller's metadata."""

    def request_moved(self, tr: Tracked, reason: str, /) -> None:
        """Its instance was lost (`reason`): it is about to be parked, to be recomputed
        elsewhere (`tr.req` is already the fresh copy; its location still names the instance
        it lost)."""

    def request_progressed(self, tr: Tracked, /) -> None:
        """Its output tokens should be recorded now (handed off, or moved)."""

    def request_finished(self, tr: Tracked, /) -> None:
        """Its one Finished is decided (tr.req carries status, usage, timings)."""
