"""What an instance engine tells the layers above, and how: the `EngineListener` it reports to
(the request table implements it) and `EventDispatch`, which routes each batch of core `Events`
from the engine's loop: token deltas to the requests' sinks (`TokenDelivery`), scheduling
changes to telemetry, hand-offs and finishes to the listener.

Generic over the engine's type (`E`: `server.engine.InstanceEngine`, which imports this module),
so the listener's hooks name the engine they come from without an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kvsched.core import Request
from kvsched.server.requests.delivery import TokenDelivery

if TYPE_CHECKING:
    from kvsched.server.telemetry.hooks import Telemetry
    from kvsched.server.telemetry.values import InstanceInfo


class Described(Protocol):
    """An engine as its dispatch sees it: what telemetry is told of its instance (a value)."""

    @property
    def info(self) -> InstanceInfo: ...


E = TypeVar("E", bound=Described)
E_contra = TypeVar("E_contra", contravariant=True)


class EngineListener(Protocol[E_contra]):
    """What an engine reports upwards, synchronously from its loop or from `attach` /
    `take_out` (implemented by the request table; the engine knows no more of it than this)."""

    def on_instance_ready(self, eng: E_contra) -> None:
        """The instance's last rank registered: it takes requests now."""

    def on_handed_off(self, eng: E_contra, req: Request) -> None:
        """A prefill instance finished `req`'s prefill and pushed its KV: it moves to its
        decode reservation."""

    def on_hand_off_failed(self, eng: E_contra, req: Request) -> None:
        """A prefill instance finished `req`'s prefill but its KV push failed: its decode
        reservation recomputes it."""

    def on_handed_off_stored(self, eng: E_contra, req: Request) -> None:
        """A prefill instance finished `req`'s prefill and its full blocks are in the storage
        tier: its decode reservation places it and fetches them."""

    def on_finished(self, eng: E_contra, req: Request) -> None:
        """`req` reached a finished state (it may be a stale copy or a decode reservation)."""

    def requeue_lost(self, req: Request, reason: str, worker_fault: bool = False) -> None:
        """`req` was live on an instance that was lost (`reason`); `worker_fault`: its worker
        died or broke the protocol (what a poison request does), not the cluster's doing."""


class EventDispatch(Generic[E]):
    """Routes one engine's core Events; owns the token delivery's cached sink grouping."""

    def __init__(self, eng: E, listener: EngineListener[E], telemetry: Telemetry) -> None:
        self.eng = eng
        self.listener = listener
        self.telemetry = telemetry
        self._deliver = TokenDelivery()

    def forget_sinks(self) -> None:
        """Drop the cached sink grouping: a tracked request's sink was replaced (Resume), or
        the scheduler whose slot table it was built from is gone."""
        self._deliver = TokenDelivery()

    def __call__(self, ev: Any) -> None:
        """Route a batch of core Events to the requests' sinks and the listener."""
        if ev.tokens:
            self._deliver(ev.tokens)
        eng, listener = self.eng, self.listener
        if ev.scheduled or ev.first_token or ev.preempted or ev.requeued:
            self.telemetry.lifecycle(eng.info, ev)
        for req in ev.handed_off:
            listener.on_handed_off(eng, req)
        for req in ev.hand_off_failed:
            listener.on_hand_off_failed(eng, req)
        for req in ev.handed_off_stored:
            listener.on_handed_off_stored(eng, req)
        for req in ev.finished:
            listener.on_finished(eng, req)
