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
"""

from __future__ import annotations

import contextlib

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


class PeerStubs:
    """The `RequestService` stubs to peers, one channel per address, kept until `close`."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self._channels: dict[str, grpc.aio.Channel] = {}

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
