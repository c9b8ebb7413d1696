"""The blocking client: `Client(address, token=...)`, then `generate`, `session`, `abort` and
`status`. Every failure is a KvschedClientError subclass (kvsched.client.errors)."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterator, Sequence
from typing import Any, Unpack

import grpc

from kvsched.client.connection import Connection
from kvsched.client.errors import Cancelled, KvschedClientError, from_rpc_error
from kvsched.client.types import (
    Finished,
    ModelInfo,
    RequestOptions,
    SessionBatch,
    TokenLogprob,
    build_request,
    logprob_rows,
)
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb


class GenerateStream:
    """One Generate call, accepted: iterate it for token batches (lists of token ids, one per
    engine step or more); when the iteration ends, `finished` holds the finished record.
    `cancel()` (or leaving a `with` block early) drops the stream, which aborts the request
    unless it was detachable."""

    def __init__(self, call: Any, queued: rpb.GenerateResponse.Queued) -> None:
        self._call = call
        self.request_id: str = queued.request_id
        self.instance: str = queued.instance
        self.finished: Finished | None = None
        # Only for a request that asked (`logprobs` / `prompt_logprobs` options): the rows of the
        # batch just yielded, one per token, and the prompt's rows once they came.
        self.last_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        try:
            for msg in self._call:
                kind = msg.WhichOneof("kind")
                if kind == "tokens":
                    t = msg.tokens
                    if t.HasField("logprobs") or t.HasField("prompt_logprobs"):
                        self.last_logprobs = logprob_rows(t.logprobs)
                        if t.HasField("prompt_logprobs") and self.prompt_logprobs is None:
                            self.prompt_logprobs = logprob_rows(t.prompt_logprobs)
                    yield list(t.token_ids)
                elif kind == "finished":
                    if self.finished is not None:  # the contract says exactly one
                        raise KvschedClientError(
                            "stream sent finished twice", request_id=self.request_id
                        )
                    self.finished = Finished.from_pb(msg.finished)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.request_id) from None
        if self.finished is None:  # the contract says this cannot happen; say so if it does
            raise KvschedClientError("stream ended without finished", request_id=self.request_id)

    def tokens(self) -> list[int]:
        """Read the stream to its end; every token, in order."""
        return [t for batch in self for t in batch]

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.finished is None:
            self.cancel()


class Session:
    """Many requests over one stream. `submit` and `abort` may be called from any thread while
    another iterates the batches (SessionBatch). `close()` half-closes: the iteration then ends
    once every accepted request has finished. Leaving a `with` block closes (cancels, on an
    exception); `cancel()` drops the stream, aborting its unfinished requests (detachable ones
    excepted)."""

    def __init__(self, stub: Any, conn: Connection, timeout: float | None, metadata: Any) -> None:
        self._outbox: queue.SimpleQueue[rpb.SessionRequest | None] = queue.SimpleQueue()
        self._tags = itertools.count()
        self._closed = False
        self._call = stub.Session(
            self._requests(), timeout=conn.deadline(timeout), metadata=conn.metadata(metadata)
        )

    def _requests(self) -> Iterator[rpb.SessionRequest]:
        while (msg := self._outbox.get()) is not None:
            yield msg

    def submit(
        self, prompt: Sequence[int], *, client_tag: str = "", **options: Unpack[RequestOptions]
    ) -> str:
        """Send a submit; returns its client tag (`client_tag`, or a fresh number). The answer
        comes in a later batch: `accepted` (with the request id) or `errors`."""
        if self._closed:
            raise Cancelled("session closed")
        tag = client_tag or str(next(self._tags))
        req = build_request(prompt, options)
        self._outbox.put(
            rpb.SessionRequest(submit=rpb.SessionRequest.Submit(request=req, client_tag=tag))
        )
        return tag

    def abort(self, request_id: str) -> None:
        """Abort one of this session's requests; its `finished` comes in a later batch."""
        if self._closed:
            raise Cancelled("session closed")
        self._outbox.put(rpb.SessionRequest(abort=rpb.SessionRequest.Abort(request_id=request_id)))

    def __iter__(self) -> Iterator[SessionBatch]:
        try:
            for msg in self._call:
                yield SessionBatch(msg)
        except grpc.RpcError as exc:
            self.close()  # frees grpc's thread waiting on the outbox for the next request
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put(None)

    def cancel(self) -> None:
        self.close()
        self._call.cancel()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.cancel()
        else:
            self.close()


class Client:
    """A blocking client of one daemon. Arguments: see Connection (token, TLS files, default
    timeout). Use it in a `with` block or call close()."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._conn = conn = Connection(
            address,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            credentials=credentials,
            timeout=timeout,
            options=options,
        )
        self._channel = conn.open_channel(grpc)
        stubs: Any = (request_service_pb2_grpc, admin_service_pb2_grpc)  # generated: untyped
        self._requests: Any = stubs[0].RequestServiceStub(self._channel)
        self._admin: Any = stubs[1].AdminServiceStub(self._channel)

    def generate(
        self,
        prompt: Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **options: Unpack[RequestOptions],
    ) -> GenerateStream:
        """Submit one request and wait until it is queued (a refusal raises here: InvalidArgument,
        ResourceExhausted, Unavailable, ...). `timeout` bounds the whole stream; `metadata` is
        sent with the call (e.g. a W3C traceparent)."""
        call = self._requests.Generate(
            build_request(prompt, options),
            timeout=self._conn.deadline(timeout),
            metadata=self._conn.metadata(metadata),
        )
        try:
            first = next(call)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, options.get("request_id", "")) from None
        except StopIteration:
            raise KvschedClientError("stream ended before queued") from None
        return GenerateStream(call, first.queued)

    def resume(
        self,
        request_id: str,
        token_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> GenerateStream:
        """Take over the rest of a request whose stream broke: its tokens after `token_ids`
        (the ones this client holds), then its finished (RequestService.Resume). NotFound,
        PermissionDenied, InvalidArgument, Unavailable (the daemon is not back yet) raise
        here."""
        call = self._requests.Resume(
            rpb.RequestServiceResumeRequest(request_id=request_id, token_ids=list(token_ids)),
            timeout=self._conn.deadline(timeout),
            metadata=self._conn.metadata(metadata),
        )
        try:
            first = next(call)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, request_id) from None
        except StopIteration:
            raise KvschedClientError("stream ended before queued", request_id=request_id) from None
        return GenerateStream(call, first.queued)

    def session(
        self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> Session:
        """Open a Session stream (see Session)."""
        return Session(self._requests, self._conn, timeout, metadata)

    def abort(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Abort a request by id, wherever it is. NotFound for an unknown id; nothing happens
        for one already finished. `metadata` is sent with the call (e.g. a caller's token)."""
        try:
            self._requests.Abort(
                rpb.AbortRequest(request_id=request_id),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(metadata),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, request_id) from None

    def status(self, instance: str = "", *, timeout: float | None = None) -> apb.GetStatusResponse:
        """AdminService.GetStatus (needs an admin token when the daemon checks tokens):
        the daemon's and each instance's queues, slots, KV blocks and prefix cache."""
        try:
            resp: apb.GetStatusResponse = self._admin.GetStatus(
                apb.GetStatusRequest(instance_id=instance),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return resp

    def list_models(
        self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> list[ModelInfo]:
        """The models the daemon serves (RequestService.ListModels), by name. `metadata` is
        sent with the call (e.g. a caller's token)."""
        try:
            resp = self._requests.ListModels(
                rpb.ListModelsRequest(),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(metadata),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [ModelInfo.from_pb(m) for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
