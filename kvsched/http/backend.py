"""The daemons behind the front end, reached only through kvsched.client: one AsyncClient per
`--server` address, a request submitted through the next one in turn and followed across
broken streams and dead daemons by kvsched.client.resumable (Resume), each request carrying
its caller's bearer token as gRPC metadata."""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Sequence
from typing import Any

import grpc

from kvsched.client import AsyncClient, KvschedClientError, ModelInfo
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, ResumableStream, resumable

_MODELS_TTL_S = 5.0
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
        if group:
            turn = zlib.crc32(group.encode()) % len(clients)
        else:
            self._turn = turn = (self._turn + 1) % len(clients)
        return clients[turn:] + clients[:turn]

    def metadata(self, token: str | None) -> tuple[tuple[str, str], ...]:
        tok = token or self.token
        return (("authorization", f"Bearer {tok}"),) if tok else ()

    def submit(
        self, prompt: Sequence[int], options: dict[str, Any], token: str | None
    ) -> ResumableStream:
        """A request, not yet sent: iterating the stream submits it. With several daemons the
        request is detachable, so a request forwarded to a peer survives the daemon this
        front end talks to (the front end aborts it explicitly when its caller goes). With one
        daemon it is not: a front end that dies (kill -9) takes its requests with it, the
        daemon aborting each as its stream drops."""
        options = {**options, "detachable": len(self.addresses) > 1}
        return resumable(
            self._rotation(options.get("sample_group", "")),
            prompt,
            retry_for_s=self.retry_for_s,
            metadata=self.metadata(token),
            **options,
        )

    async def abort(self, stream: ResumableStream, token: str | None, stop: bool = False) -> None:
        """Abort the request wherever it runs (`stop`: it ended at a stop string, so it finishes
        with reason stop); a request already finished or unknown is fine."""
        with contextlib.suppress(KvschedClientError):
            await stream.client.abort(
                stream.request_id, timeout=5.0, metadata=self.metadata(token), stop=stop
            )

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
        for c in self._clients:
            await c.close()
        self._clients = []
