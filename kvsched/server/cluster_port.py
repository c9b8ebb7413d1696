"""What the server asks of a cluster: the `ClusterPort` protocol the request table holds
(`RequestTable.cluster`; `kvsched.cluster.node.ClusterNode` implements it, set by the
composition root). The server imports nothing of kvsched.cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from kvsched.core import Request
from kvsched.core.protocol import FinishReason
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.requests.record import PeerInstance, Tracked
from kvsched.v1 import request_service_pb2


class ClusterPort(Protocol):
    """What the server asks of a cluster (`kvsched.cluster.node.ClusterNode`); the server
    imports nothing of kvsched.cluster."""

    daemon_id: str  # this daemon's id in the cluster (its journal records name it)

    def route_new(
        self, req: Request, carrier: dict[str, str], owner: str, model: str = ""
    ) -> tuple[InstanceEngine | PeerInstance, str]:
        """Choose where a new request runs (an engine here or a peer's instance) and the
        owner it is tracked under."""
        ...

    def forward(
        self,
        tr: Tracked,
        msg: request_service_pb2.GenerateRequest,
        remote: Any,
        carrier: dict[str, str],
        deadline_s: float | None,
    ) -> asyncio.Task[None]:
        """Relay `tr` from the peer's instance `remote` (the one `route_new` chose)."""
        ...

    def decode_peer(self, model: str, count: bool = True) -> PeerInstance | None:
        """A peer's decode instance of `model` to hand a prefilled request to (P/D across
        daemons; `count`: the choice is a request sent to it), or None when no live peer has
        one."""
        ...

    async def forward_confirmed(self, tr: Tracked) -> None:
        """Wait until the peer `tr` was forwarded to has accepted it (its first answer: it
        journals it before that), or until it is recorded here, or its relay has ended."""
        ...

    async def abort_elsewhere(
        self, request_id: str, owner: str | None, reason: FinishReason = FinishReason.ABORT
    ) -> bool: ...

    def caller_of(self, carrier: dict[str, str], caller: str) -> str: ...

    def forwarded_by(self, carrier: Mapping[str, str]) -> str:
        """The peer daemon that forwarded (or relayed) this call here, or "" for a client's."""
        ...

    def from_peer(self, carrier: Mapping[str, str], caller: str) -> bool:
        """Whether the call came from a peer daemon (forwarded, with the cluster's token when
        auth is on)."""
        ...

    def hand_over_from(self, carrier: dict[str, str], caller: str) -> str:
        """The daemon handing this Resume's request over to this one (its live owner, with no
        instance to run it: adopt it here, then serve the Resume), or ""."""
        ...

    def resume_at(
        self,
        daemon_id: str,
        msg: request_service_pb2.RequestServiceResumeRequest,
        owner: str,
        carrier: dict[str, str],
    ) -> AsyncIterator[request_service_pb2.RequestServiceResumeResponse]: ...

    async def takeovers_settled(self) -> None:
        """Wait (bounded, about a second) until no takeover pass runs on this daemon."""
        ...

    def adopting(self, daemon_id: str) -> bool:
        """Whether a takeover pass of `daemon_id` runs on this daemon now."""
        ...

    def refuse_if_fenced(self) -> None:
        """Unavailable while this daemon is fenced: a Resume of a request it does not hold
        is not looked up in a journal it cannot reach."""
        ...

    def cluster_status(self) -> Any: ...
