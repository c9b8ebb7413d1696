"""The daemons behind the front end, reached only through kvsched.client: one AsyncClient per
`--server` address; every request over a Session stream (kvsched.http.session: one per address
and bearer token, requests submitted through the addresses in turn, the samples of one sample
group through one address), followed across broken streams and dead daemons by Resume when it
is detachable (several addresses), each stream carrying its caller's bearer token as gRPC
metadata."""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import grpc

from kvsched.client import AsyncClient, KvschedClientError, ModelInfo
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS
from kvsched.http.session import RequestStream, SessionLink

_MODELS_TTL_S = 5.0
_MAX_LINKS = 256  # sessions kept open (one per address and token); idle ones closed beyond
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Backend:
    """The kvsched daemons. Create inside the serving event loop; `close()` at shutdown.
    `token` is used for calls whose HTTP request brought none."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        retry_for_s: float = 10.0,
        timeout_s: float | None = None,
        sessions: int = 1,
    ) -> None:
        if not addresses:
            raise ValueError("at least one --server address is needed")
        self.addresses = list(addresses)
        self.token = token
        self.retry_for_s = retry_for_s
        self.timeout_s = timeout_s
        self._tls = (tls_ca, tls_cert, tls_key)
        self._clients: list[AsyncClient] = []
        self._turn = 0
        # Session streams per address and token, requests spread over them in turn (a
        # stream's submits are written, and read by the daemon, one at a time; at c=64 on the
        # sim, 4 streams gave no more than 1: bench.frontend_ab, BENCHMARKS 18).
        self.sessions = max(1, sessions)
        self._spread = 0
        self._links: dict[tuple[int, str, int], SessionLink] = {}
        # ListModels answers by token (a cached answer never serves a caller the daemon
        # would refuse): token -> (when, models)
        self._models: dict[str, tuple[float, list[ModelInfo] | None]] = {}

    def _all(self) -> list[AsyncClient]:
        if not self._clients:
            ca, cert, key = self._tls
            self._clients = [
                AsyncClient(
                    a, tls_ca=ca, tls_cert=cert, tls_key=key, options=RESUMABLE_CHANNEL_OPTIONS
                )
                for a in self.addresses
            ]
        return self._clients

    def _rotation(self, group: str = "") -> list[AsyncClient]:
        """Every client, starting with the next one in turn (spreads requests, and a dead
        daemon is skipped by the resumable stream's failover); the samples of one sample
        group all start at one daemon (it computes their prompt once)."""
        clients = self._all()
        turn = self._next_turn(group)
        return clients[turn:] + clients[:turn]

    def _next_turn(self, group: str) -> int:
        """The index of the address a request starts at: the next in turn, or its sample
        group's (the same for every sample of the group)."""
        n = len(self._all())
        if group:
            return zlib.crc32(group.encode()) % n
        self._turn = (self._turn + 1) % n
        return self._turn

    def metadata(self, token: str | None) -> tuple[tuple[str, str], ...]:
        tok = token or self.token
        return (("authorization", f"Bearer {tok}"),) if tok else ()

    def submit(
        self, prompt: Sequence[int], options: dict[str, Any], token: str | None
    ) -> RequestStream:
        """A request, not yet sent: its first `next_batch()` submits it. With several daemons
        the request is detachable, so a request forwarded to a peer survives the daemon this
        front end talks to (the front end aborts it explicitly when its caller goes). With one
        daemon it is not: a front end that dies (kill -9) takes its requests with it, the
        daemon aborting each as its session drops."""
        options = {**options, "detachable": len(self.addresses) > 1}
        group = options.get("sample_group", "")
        return RequestStream(
            prompt,
            options,
            self.metadata(token),
            lambda s: self._place(s, token or self.token),
            lambda: self._rotation(group),
            self.retry_for_s,
        )

    def _place(self, stream: RequestStream, token: str) -> SessionLink:
        """Submit `stream` on the session of the next address in turn (opened if needed); a
        sample of a sample group on the session of its group's address (see `_rotation`)."""
        clients = self._all()
        turn = self._next_turn(stream.options.get("sample_group", ""))
        self._spread = (self._spread + 1) % self.sessions
        key = (turn, token, self._spread)
        link = self._links.get(key)
        if link is None or link.dead:
            if len(self._links) >= _MAX_LINKS:
                self._close_idle()
            link = SessionLink(clients[turn], stream.metadata)
            self._links[key] = link
        link.submit(stream)
        return link

    def _close_idle(self) -> None:
        for key, link in list(self._links.items()):
            if link.dead or not link.streams:
                link.close()
                del self._links[key]

    async def abort(self, stream: RequestStream, token: str | None, stop: bool = False) -> None:
        """Abort the request wherever it runs (`stop`: it ended at a stop string, so it finishes
        with reason stop); a request already finished or unknown is fine."""
        await stream.abort(stop)

    async def list_models(self, token: str | None) -> list[ModelInfo] | None:
        """The daemons' models (cached a few seconds per token), or None when no daemon
        answers. Unauthenticated / PermissionDenied raise (the caller's token is refused)."""
        at, cached = self._models.get(token or "", (float("-inf"), None))
        if time.monotonic() - at < _MODELS_TTL_S:
            return cached
        models: list[ModelInfo] | None = None
        for client in self._rotation():
            try:
                models = await client.list_models(timeout=5.0, metadata=self.metadata(token))
            except KvschedClientError as exc:
                if exc.code in _REFUSALS:
                    raise  # the caller's token: theirs to fix (401 / 403)
                continue
            break
        if len(self._models) > 1000:
            self._models.clear()
        self._models[token or ""] = (time.monotonic(), models)
        return models

    async def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links = {}
        for c in self._clients:
            await c.close()
        self._clients = []
