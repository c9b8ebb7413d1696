"""The wire between a forwarding daemon and its peers' `RequestService` (forward.py's calls):
the metadata keys a forwarded call carries, `PeerStubs` (owns the channels to peers and the
cluster token's authorization), which failures may be retried, and a peer's Finished read
back into the local request (`apply_finished`, pure). The keys:

    x-kvsched-forwarded-by   this daemon's id: the peer places the request itself, never
                             forwards it again
    x-kvsched-instance       the instance chosen (the peer uses it while it takes requests)
    x-kvsched-owner          the submitting client's principal, so an Abort by that client works
                             on the peer too (honoured only from a caller holding the cluster
                             token, or when the peer runs without auth: `relay_owner`)
    authorization            `Bearer <cluster_token>` when the daemon has one (role client)

A Resume this daemon sends as the request's owner to hand it over carries `x-kvsched-hand-over`
besides `x-kvsched-forwarded-by` and `x-kvsched-owner`; a client's Resume relayed to the
request's owner carries `x-kvsched-relayed`.

A peer that already runs the very request a forward sends it (same id, model and prompt: an
earlier forward of it reached the peer and its call broke) refuses it with INVALID_ARGUMENT and
the error type `RequestAlreadyLive` in the `kvsched-error` trailer (server/errors.py):
`live_there` reads that marker, never the message, and the forwarder follows the request there.

A paused, hung or cut-off peer neither answers nor fails a call (its kernel keeps the TCP
connection), so every call to a peer is read through `PeerStubs.read`: once the peer has missed
its membership heartbeats (`silent`, set by the cluster node: no refresh of its entry seen for
3/4 of the TTL, when that peer, if it runs at all, has fenced itself) the call is cancelled and
fails as UNAVAILABLE (`silent_error`), like a peer that died, so nothing waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvsched import codec
from kvsched.core import Request, lifecycle
from kvsched.core.errors import RequestAlreadyLive
from kvsched.server.errors import ERROR_TYPE_KEY
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.v1 import request_service_pb2_grpc

FORWARDED_BY = "x-kvsched-forwarded-by"
FORWARD_INSTANCE = "x-kvsched-instance"
FORWARD_OWNER = "x-kvsched-owner"
RELAYED = "x-kvsched-relayed"  # a Resume relayed to the request's owner: never relayed again
HAND_OVER = "x-kvsched-hand-over"  # a Resume from the request's owner: adopt it, then serve it
# A peer's call that failed with one of these may be tried again (elsewhere, or followed).
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
    }
)


WATCH_S = 0.25  # how often calls to peers are checked against the peers' heartbeats


class PeerStubs:
    """The `RequestService` stubs to peers, one channel per address, kept until `close`; calls
    read through `read` are given up once their peer misses its heartbeats."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Whether the daemon at an address has missed its membership heartbeats (the node's).
        self.silent: Callable[[str], bool] = lambda address: False
        self._calls: dict[str, dict[Any, list[bool]]] = {}  # address -> call -> [given up]
        self._watch: asyncio.Task[None] | None = None
        self.num_given_up = 0  # calls cancelled because their peer went silent

    async def read(self, call: Any, address: str) -> AsyncIterator[Any]:
        """`call`'s messages; `silent_error` (UNAVAILABLE) once the daemon at `address` has
        missed its heartbeats, before or while the call waits (see the module docstring)."""
        if self.silent(address):
            call.cancel()
            self.num_given_up += 1
            raise silent_error(address)
        flag = [False]
        self._calls.setdefault(address, {})[call] = flag
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop(), name="peers")
        try:
            async for out in call:
                yield out
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            task = asyncio.current_task()
            if flag[0] and (task is None or not task.cancelling()):
                raise silent_error(address) from None  # cancelled by the watch, not the caller
            raise
        finally:
            calls = self._calls.get(address)
            if calls is not None:
                calls.pop(call, None)
                if not calls:
                    del self._calls[address]

    async def _watch_loop(self) -> None:
        while self._calls:
            await asyncio.sleep(WATCH_S)
            for address, calls in list(self._calls.items()):
                if calls and self.silent(address):
                    for call, flag in list(calls.items()):
                        if not flag[0]:
                            flag[0] = True
                            self.num_given_up += 1
                            call.cancel()

    def stub(self, address: str) -> request_service_pb2_grpc.RequestServiceStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", 64 << 20)]
            )
        return request_service_pb2_grpc.RequestServiceStub(ch)  # type: ignore[no-untyped-call]

    def auth(self) -> list[tuple[str, str]]:
        """The authorization metadata (the cluster token), or none."""
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
        self._channels.clear()


def ended() -> grpc.aio.AioRpcError:
    """The error a peer's stream that ended without Finished counts as (retryable)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="peer ended the stream without Finished",
    )


def silent_error(address: str) -> grpc.aio.AioRpcError:
    """The error a call to a peer that missed its heartbeats fails with (retryable)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"the daemon at {address} has missed its membership heartbeats (paused, hung "
        "or cut off); not waited on",
    )


def live_there(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a peer refused a forwarded Generate because it runs that same request already
    (the typed `RequestAlreadyLive` marker in the trailer; an id reused for another request,
    or any other refusal, is not)."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return False
    trailer = dict(exc.trailing_metadata() or ())
    return trailer.get(ERROR_TYPE_KEY) == RequestAlreadyLive.__name__


def apply_finished(req: Request, fin: rpb.Finished, now: float) -> None:
    """A peer's Finished into the local request: status, reason, cached tokens, and its
    timings moved onto this daemon's clock (from the request's arrival here)."""
    reason = codec.finish_reason_from_proto(fin.reason)
    req.num_cached_tokens = fin.usage.cached_tokens
    t = fin.timings
    lifecycle.finish_remote(req, reason, fin.message, now, t.queue_s, t.ttft_s, t.e2e_s)


def relay_owner(carrier: dict[str, str], caller: str, cluster_principal: str | None) -> str | None:
    """The owner a forwarded request keeps on the peer: the original client's principal when
    the call came from a daemon (cluster token, or no auth configured); None otherwise."""
    if FORWARDED_BY not in carrier:
        return None
    if cluster_principal is not None and caller != cluster_principal:
        return None
    return carrier.get(FORWARD_OWNER, "")
