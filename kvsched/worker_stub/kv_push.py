"""KV hand-off between workers (prefill -> decode): pushing a finished prefill's blocks to the
peer the daemon named (sending side) and serving `KvTransferService.Push` (receiving side).

Both sides meet the step loop only at step boundaries: the engine's kv_sender notes a due push
during step(), the loop performs it before the step's report goes out (a failed one lists its
handle in the report's `failed`); a received push waits in the session's inbox until the loop
finds its handle held, then its data is written into the handle's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvsched.core.protocol import KvSend, StepReport
from kvsched.v1 import kv_transfer_service_pb2 as kv_pb2
from kvsched.v1 import kv_transfer_service_pb2_grpc as kv_grpc
from kvsched.worker_stub.channels import SERVER_OPTIONS, advertised_address, open_channel
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.stats import WorkerStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReceivedPush:
    """A received push waiting for the step boundary; the future gets (code, message)."""

    request: kv_pb2.PushRequest
    future: asyncio.Future[tuple[grpc.StatusCode, str]]


@dataclass(slots=True)
class _DuePush:
    send: KvSend
    address: str
    data: bytes


class _Inbox(Protocol):
    def put_nowait(self, item: ReceivedPush, /) -> None: ...


class KvReceiver(Protocol):
    """What the Push servicer calls, looked up per call (tests replace receive_kv)."""

    def check_kv_auth(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool: ...

    async def receive_kv(self, request: kv_pb2.PushRequest) -> tuple[grpc.StatusCode, str]: ...


def num_send_blocks(engine: WorkerEngine, handle: int) -> int:
    """Blocks the engine exports for a due KvSend (it passes the whole dst list; the receiver
    needs exactly as many ids as exported blocks). Called from inside step(), handle still held.
    TODO(engine): have WorkerEngine pass the KvSend cut to the exported block count."""
    return -(-engine.num_computed(handle) // engine.block_size)


class KvPush:
    """One worker rank's KV pushes, both ways, over all its sessions: the peers' addresses (the
    daemon's latest Peers message), channels to them, pushes due after the current step, and
    received pushes waiting for their handle."""

    def __init__(
        self,
        instance_id: str,
        rank: int,
        stats: WorkerStats,
        *,
        channel_credentials: grpc.ChannelCredentials | None,
        listen: str | None,
        server_credentials: grpc.ServerCredentials | None,
        token: str | None,
        push_timeout_s: float,
        push_wait_s: float,
    ) -> None:
        self.instance_id = instance_id
        self.rank = rank
        self.stats = stats
        self.listen = listen
        self._credentials = channel_credentials
        self._server_credentials = server_credentials
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._push_timeout_s = push_timeout_s
        self._push_wait_s = push_wait_s
        self.address: str | None = None  # host:port peers push to, once the server started
        self.peers: dict[tuple[str, int], str] = {}  # (instance_id, rank) -> KV address
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.pending: list[ReceivedPush] = []  # received, waiting for the step boundary
        self.due: list[_DuePush] = []  # to push before this step's report goes out

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # ---- sending side ---------------------------------------------------------------------------

    def queue(self, engine: WorkerEngine, send: KvSend, data: bytes) -> None:
        """The engine's kv_sender (called inside step(), maybe in a thread): note the push; the
        step loop performs it before the step's report goes out."""
        address = self.peers.get((send.dst_instance, self.rank))
        if address is None:
            raise LookupError(
                f"no KV address for instance {send.dst_instance!r} rank {self.rank}: "
                f"the daemon sent no Peers entry for it"
            )
        num_blocks = num_send_blocks(engine, send.handle)
        cut = KvSend(
            send.handle, send.dst_instance, send.dst_handle, send.dst_block_ids[:num_blocks]
        )
        self.due.append(_DuePush(cut, address, data))

    async def push_all(self, due: list[_DuePush], report: StepReport | None) -> None:
        """Push concurrently; a failed push lists its handle in the report's `failed`."""
        started = time.perf_counter()
        results = await asyncio.gather(*(self._push(p) for p in due), return_exceptions=True)
        self.stats.kv_push_s += time.perf_counter() - started
        for p, result in zip(due, results, strict=True):
            if isinstance(result, Exception):
                self.stats.num_kv_push_failures += 1
                log.warning(
                    "KV push of handle %d to %s handle %d at %s failed: %s",
                    p.send.handle,
                    p.send.dst_instance,
                    p.send.dst_handle,
                    p.address,
                    result,
                )
                if report is not None:
                    report.failed.append(p.send.handle)
            else:
                self.stats.num_kv_pushes += 1
                self.stats.num_kv_push_blocks += len(p.send.dst_block_ids)

    async def _push(self, p: _DuePush) -> None:
        channel = self._channels.get(p.address)
        if channel is None:
            channel = self._channels[p.address] = open_channel(p.address, self._credentials)
        request = kv_pb2.PushRequest(
            src_instance_id=self.instance_id,
            dst_instance_id=p.send.dst_instance,
            rank=self.rank,
            dst_handle=p.send.dst_handle,
            dst_block_ids=p.send.dst_block_ids,
            kv_data=p.data,
        )
        stub = kv_grpc.KvTransferServiceStub(channel)
        await stub.Push(request, timeout=self._push_timeout_s, metadata=self._metadata)

    # ---- receiving side -------------------------------------------------------------------------

    async def start_server(self, receiver: KvReceiver) -> grpc.aio.Server:
        assert self.listen is not None
        server = grpc.aio.server(options=SERVER_OPTIONS)
        kv_grpc.add_KvTransferServiceServicer_to_server(_KvTransferServicer(receiver), server)
        if self._server_credentials is None:
            port = server.add_insecure_port(self.listen)
        else:
            port = server.add_secure_port(self.listen, self._server_credentials)
        await server.start()
        self.address = advertised_address(self.listen, port)
        log.info("accepting KV pushes at %s", self.address)
        return server

    async def receive(
        self, request: kv_pb2.PushRequest, inbox: _Inbox | None
    ) -> tuple[grpc.StatusCode, str]:
        """Queue a received push for the step boundary and wait for its outcome: OK once the
        data is written into the blocks of a held handle."""
        if request.dst_instance_id and request.dst_instance_id != self.instance_id:
            return _refused(
                f"this is instance {self.instance_id!r}, not {request.dst_instance_id!r}"
            )
        if request.rank != self.rank:
            return _refused(
                f"this is rank {self.rank}; a rank {request.rank} pushes to rank {request.rank}"
            )
        if inbox is None:
            return _refused(
                f"instance {self.instance_id!r} rank {self.rank} is not connected to the daemon"
            )
        push = ReceivedPush(request, asyncio.get_running_loop().create_future())
        inbox.put_nowait(push)
        try:
            return await asyncio.wait_for(push.future, self._push_wait_s)
        except TimeoutError:
            return _refused(
                f"handle {request.dst_handle} was not placed on instance {self.instance_id!r} "
                f"within {self._push_wait_s} s"
            )

    def resolve(self, engine: WorkerEngine, max_placed: int) -> None:
        """Write pushes for held handles; keep those whose placement may still be on its way
        (a handle above every handle placed so far: handles are issued in increasing order)."""
        waiting = []
        for push in self.pending:
            handle = push.request.dst_handle
            if push.future.done():  # the pusher gave up
                continue
            if engine.holds(handle):
                _answer(push, *self._import_kv(engine, push.request))
            elif handle > max_placed:
                waiting.append(push)
            else:
                _answer(
                    push,
                    *_refused(
                        f"handle {handle} is not held here (finished, dropped or never placed)"
                    ),
                )
        self.pending = waiting

    def _import_kv(
        self, engine: WorkerEngine, request: kv_pb2.PushRequest
    ) -> tuple[grpc.StatusCode, str]:
        try:
            engine.executor.import_kv(request.dst_block_ids[:], request.kv_data)
        except ValueError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"handle {request.dst_handle}: {e}"
        self.stats.num_kv_received += 1
        return grpc.StatusCode.OK, ""

    def fail_pending(self, inbox: asyncio.Queue[Any]) -> None:
        """The session ended: refuse every push still waiting, in the inbox or pending."""
        while not inbox.empty():
            item = inbox.get_nowait()
            if isinstance(item, ReceivedPush):
                self.pending.append(item)
        for push in self.pending:
            _answer(push, *_refused("the worker lost its daemon stream; its cache is gone"))
        self.pending = []

    def check_auth(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when KV pushes need no token or `metadata` carries this worker's."""
        if not self._metadata:
            return True
        return any((k, v) == self._metadata[0] for k, v in metadata or ())


class _KvTransferServicer(kv_grpc.KvTransferServiceServicer):
    def __init__(self, receiver: KvReceiver) -> None:
        self._worker = receiver

    async def Push(
        self, request: kv_pb2.PushRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.PushResponse:
        if not self._worker.check_kv_auth(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong KV push token")
        code, message = await self._worker.receive_kv(request)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, message)
        return kv_pb2.PushResponse(num_blocks=len(request.dst_block_ids))


def _refused(message: str) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.FAILED_PRECONDITION, message


def _answer(push: ReceivedPush, code: grpc.StatusCode, message: str) -> None:
    if not push.future.done():
        push.future.set_result((code, message))
