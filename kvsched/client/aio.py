"""The asyncio client: `AsyncClient(address, token=...)`, then `await generate(...)`,
`session()`, `abort`, `status`. The same calls, records and errors as kvsched.client.sync."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack

import grpc
import grpc.aio

from kvsched.client import batch as batching
from kvsched.client.connection import Connection
from kvsched.client.errors import Cancelled, KvschedClientError, NoAnswer, from_rpc_error
from kvsched.client.types import (
    Finished,
    ModelInfo,
    RequestOptions,
    SessionBatch,
    TokenLogprob,
    build_request,
    build_submit,
    logprob_rows,
    session_abort,
)
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc, common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb


def _serialize(msg: rpb.SessionRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class AsyncGenerateStream:
    """One Generate call, accepted: `async for batch in stream` gives token batches (lists of
    token ids); then `finished` holds the finished record. `cancel()` (or leaving an
    `async with` block early) drops the stream, which aborts the request unless detachable."""

    def __init__(self, call: Any, queued: rpb.GenerateResponse.Queued) -> None:
        self._call = call
        self.request_id: str = queued.request_id
        self.instance: str = queued.instance
        self.finished: Finished | None = None
        # Only for a request that asked (`logprobs` / `prompt_logprobs` options): the rows of the
        # batch just yielded, one per token, and the prompt's rows once they came.
        self.last_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                kind = msg.WhichOneof("kind")
                if kind == "tokens":
                    t = msg.tokens
                    if t.HasField("logprobs") or t.HasField("prompt_logprobs"):
                        self._logprobs(t)
                    yield list(t.token_ids)
                elif kind == "finished":
                    if self.finished is not None:  # the contract says exactly one
                        raise KvschedClientError(
                            "stream sent finished twice", request_id=self.request_id
                        )
                    self.finished = Finished.from_pb(msg.finished)
        except grpc.RpcError as exc:  # asyncio.CancelledError is not one: it propagates
            raise from_rpc_error(exc, self.request_id) from None
        if self.finished is None:
            raise KvschedClientError("stream ended without finished", request_id=self.request_id)

    def _logprobs(self, t: rpb.GenerateResponse.Tokens) -> None:
        self.last_logprobs = logprob_rows(t.logprobs)
        if t.HasField("prompt_logprobs") and self.prompt_logprobs is None:
            self.prompt_logprobs = logprob_rows(t.prompt_logprobs)

    async def tokens(self) -> list[int]:
        """Read the stream to its end; every token, in order."""
        return [t async for batch in self for t in batch]

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.finished is None:
            self.cancel()


async def _first_answer(call: Any, bound: float | None, address: str, request_id: str) -> Any:
    """The call's first message, waiting at most `bound` seconds (None: no bound). A call
    that gets no answer in time is cancelled and raises NoAnswer."""
    try:
        if bound is None:
            return await call.read()
        async with asyncio.timeout(bound):
            return await call.read()
    except TimeoutError:
        call.cancel()
        raise NoAnswer(
            f"no answer from {address} within {bound:g} s (daemon paused, hung or unreachable)",
            request_id=request_id,
        ) from None
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, request_id) from None


class AsyncSession:
    """Many requests over one stream: `await submit(...)` and `await abort(id)` from any task
    while one task does `async for batch in session` (SessionBatch). `await close()`
    half-closes: the iteration ends once every accepted request has finished. Leaving an
    `async with` block closes; `cancel()` drops the stream, aborting its unfinished requests
    (detachable ones excepted).

    `batch_limit`: 0 until the daemon's initial metadata said it takes several submits in one
    message (kvsched.client.batch), then the largest such message in bytes; `batches_sent`
    and `batched_submits` count the batches `submit_many_built` wrote and the submits in
    them."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._tags = itertools.count()
        self._closed = False
        self.batch_limit = 0
        self.batches_sent = 0
        self.batched_submits = 0
        self._header: asyncio.Future[Any] = asyncio.ensure_future(call.initial_metadata())
        self._header.add_done_callback(self._read_header)

    def _read_header(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.batch_limit = batching.limit_from(fut.result())

    async def header_read(self, timeout: float) -> int:
        """Wait at most `timeout` seconds for the daemon's initial metadata (a current daemon
        sends it as the stream opens; an older one only with its first answer); then
        `batch_limit`."""
        if not self._header.done():
            await asyncio.wait([self._header], timeout=timeout)
        return self.batch_limit

    async def _write(self, msg: rpb.SessionRequest | bytes) -> None:
        if self._closed:
            raise Cancelled("session closed")
        try:
            await self._call.write(msg)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def submit(
        self, prompt: Sequence[int], *, client_tag: str = "", **options: Unpack[RequestOptions]
    ) -> str:
        """Send a submit; returns its client tag (`client_tag`, or a fresh number). The answer
        comes in a later batch: `accepted` (with the request id) or `errors`."""
        tag = client_tag or str(next(self._tags))
        await self._write(build_submit(prompt, options, tag))
        return tag

    async def submit_built(self, msg: rpb.SessionRequest) -> str:
        """`submit` of one built beforehand (`build_submit`): a caller that sends at set times
        (a replay) builds ahead, so encoding a long prompt does not delay its send. Returns
        its client tag."""
        await self._write(msg)
        return msg.submit.client_tag

    async def submit_many_built(self, msgs: Sequence[rpb.SessionRequest]) -> list[str]:
        """Several built submits (`build_submit`) at once, in order: in one message
        (SessionRequest.batch; a few past batch.PART_BYTES or `batch_limit`) once the daemon
        said it takes batches, else one message each. Each is answered as a single submit
        would be. Returns their client tags."""
        if len(msgs) < 2 or not self.batch_limit:
            for msg in msgs:
                await self._write(msg)
            return [msg.submit.client_tag for msg in msgs]
        singles = (msg.SerializeToString() for msg in msgs)
        for run in batching.groups(singles, min(self.batch_limit, batching.PART_BYTES)):
            if len(run) == 1:
                await self._write(run[0])
            else:
                await self._write(batching.encode(run))
                self.batches_sent += 1
                self.batched_submits += len(run)
        return [msg.submit.client_tag for msg in msgs]

    async def abort(self, request_id: str, *, stop: bool = False) -> None:
        """Abort one of this session's requests; its `finished` comes in a later batch.
        `stop`: the client found a stop condition of its own (it finishes with reason stop)."""
        await self._write(rpb.SessionRequest(abort=session_abort(request_id, stop)))

    async def __aiter__(self) -> AsyncIterator[SessionBatch]:
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                yield SessionBatch(msg)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await self._call.done_writing()
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()
        self._header.cancel()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.cancel()
        else:
            await self.close()


class AsyncClient:
    """An asyncio client of one daemon; create it inside the event loop that uses it.
    Arguments: see Connection (token, TLS files, default timeout). Use `async with` or
    `await close()`."""

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
        self._channel = conn.open_channel(grpc.aio)
        stubs: Any = (request_service_pb2_grpc, admin_service_pb2_grpc)  # generated: untyped
        self._requests: Any = stubs[0].RequestServiceStub(self._channel)
        self._admin: Any = stubs[1].AdminServiceStub(self._channel)
        # RequestService.Session, writing messages or bytes already serialized (a batch of
        # submits is assembled from theirs: kvsched.client.batch).
        self._session_call: Any = self._channel.stream_stream(
            "/kvsched.v1.RequestService/Session",
            request_serializer=_serialize,
            response_deserializer=rpb.SessionResponse.FromString,
            _registered_method=True,  # as the generated stub's
        )

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        first_answer_timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncGenerateStream:
        """Submit one request and wait until it is queued (a refusal raises here:
        InvalidArgument, ResourceExhausted, Unavailable, ...). `timeout` bounds the whole
        stream; `metadata` is sent with the call (e.g. a W3C traceparent);
        `first_answer_timeout` bounds the wait for `queued` (NoAnswer, the call cancelled)."""
        call = self._requests.Generate(
            build_request(prompt, options),
            timeout=self._conn.deadline(timeout),
            metadata=self._conn.metadata(metadata),
        )
        rid = options.get("request_id", "")
        first = await _first_answer(call, first_answer_timeout, self._conn.address, rid)
        if first is grpc.aio.EOF:
            raise KvschedClientError("stream ended before queued")
        return AsyncGenerateStream(call, first.queued)

    async def resume(
        self,
        request_id: str,
        token_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        first_answer_timeout: float | None = None,
    ) -> AsyncGenerateStream:
        """Take over the rest of a request whose stream broke: its tokens after `token_ids`
        (the ones this client holds), then its finished (RequestService.Resume). NotFound,
        PermissionDenied, InvalidArgument, Unavailable (the daemon is not back yet) raise
        here; NoAnswer when `first_answer_timeout` passes without one. See
        kvsched.client.resumable for a stream that does this by itself."""
        call = self._requests.Resume(
            rpb.RequestServiceResumeRequest(request_id=request_id, token_ids=list(token_ids)),
            timeout=self._conn.deadline(timeout),
            metadata=self._conn.metadata(metadata),
        )
        first = await _first_answer(call, first_answer_timeout, self._conn.address, request_id)
        if first is grpc.aio.EOF:
            raise KvschedClientError("stream ended before queued", request_id=request_id)
        return AsyncGenerateStream(call, first.queued)

    def session(
        self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> AsyncSession:
        """Open a Session stream (see AsyncSession)."""
        call = self._session_call(
            timeout=self._conn.deadline(timeout), metadata=self._conn.metadata(metadata)
        )
        return AsyncSession(call)

    async def abort(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        stop: bool = False,
    ) -> None:
        """Abort a request by id, wherever it is. NotFound for an unknown id; nothing happens
        for one already finished. `metadata` is sent with the call (e.g. the submitter's
        bearer token, for a front end that passes each user's token through). `stop`: the
        client found a stop condition of its own (a stop string): the request finishes with
        reason stop, not abort (AbortRequest.reason)."""
        reason = common_pb2.FINISH_REASON_STOP if stop else common_pb2.FINISH_REASON_UNSPECIFIED
        try:
            await self._requests.Abort(
                rpb.AbortRequest(request_id=request_id, reason=reason),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(metadata),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, request_id) from None

    async def status(
        self, instance: str = "", *, timeout: float | None = None
    ) -> apb.GetStatusResponse:
        """AdminService.GetStatus (needs an admin token when the daemon checks tokens)."""
        try:
            resp: apb.GetStatusResponse = await self._admin.GetStatus(
                apb.GetStatusRequest(instance_id=instance),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return resp

    async def list_models(
        self, *, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = ()
    ) -> list[ModelInfo]:
        """The models the daemon serves (RequestService.ListModels), by name. `metadata` is
        sent with the call (e.g. a bearer token per caller)."""
        try:
            resp = await self._requests.ListModels(
                rpb.ListModelsRequest(),
                timeout=self._conn.deadline(timeout),
                metadata=self._conn.metadata(metadata),
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [ModelInfo.from_pb(m) for m in resp.models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
