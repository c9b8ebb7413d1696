"""WorkerService.Connect: one bidirectional stream per worker process (one TP rank).

Registered by hand rather than through the generated helper so that Tasks are serialized once
and the same bytes are written to every rank: the response serializer passes bytes through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvsched import codec
from kvsched.core import ProtocolError, Unavailable
from kvsched.server.instances.engine import InstanceEngine, RankConn
from kvsched.server.instances.registry import InstanceRegistry
from kvsched.v1 import worker_service_pb2 as wpb

log = logging.getLogger("kvsched.workers")

HELLO_TIMEOUT_S = 10.0


def _serialize(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def worker_service_handler(registry: InstanceRegistry) -> grpc.GenericRpcHandler:
    servicer = WorkerServicer(registry)
    return grpc.method_handlers_generic_handler(
        "kvsched.v1.WorkerService",
        {
            "Connect": grpc.stream_stream_rpc_method_handler(
                servicer.Connect,
                request_deserializer=wpb.ConnectRequest.FromString,
                response_serializer=_serialize,
            )
        },
    )


class WorkerServicer:
    """Attaches each worker rank to its instance in `registry`, then relays: Tasks (and peer
    lists) from the instance's queue out, StepReports in to its engine."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self.registry = registry

    async def Connect(
        self, request_iterator: AsyncIterator[wpb.ConnectRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), HELLO_TIMEOUT_S)
        except (TimeoutError, StopAsyncIteration):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a worker must send Hello first, within {HELLO_TIMEOUT_S:.0f} s",
            )
            return
        if first.WhichOneof("kind") != "hello":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the first message must be Hello, got {first.WhichOneof('kind')!r}",
            )
            return
        gate = self.registry.worker_gate
        if gate is not None:
            try:
                redirect = await gate(first.hello)
            except Unavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                return
            if redirect is not None:  # another daemon owns the instance (protocol step 11)
                yield redirect
                return
        try:
            eng, conn = self.registry.attach_worker(first.hello)
        except ProtocolError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        log.info("worker connected: instance %s rank %d", eng.instance_id, conn.rank)
        reader = asyncio.get_running_loop().create_task(self._read(it, eng, conn))
        reason = "worker stream ended"
        try:
            yield self.registry.welcome(eng, conn)
            peers = self.registry.peers_message()
            if peers is not None:
                yield peers
            while True:
                item = await conn.queue.get()
                if item is None:
                    reason = "instance taken out"
                    return
                if isinstance(item, Exception):
                    # A violation is final (FAILED_PRECONDITION); a lost peer rank or a silent
                    # worker is not this worker's fault: UNAVAILABLE tells it to reconnect.
                    reason = str(item)
                    code = (
                        grpc.StatusCode.FAILED_PRECONDITION
                        if isinstance(item, ProtocolError)
                        else grpc.StatusCode.UNAVAILABLE
                    )
                    await context.abort(code, f"instance {eng.instance_id} taken out: {item}")
                    return
                yield item
        finally:
            reader.cancel()
            eng.detach(conn, reason)
            log.info(
                "worker disconnected: instance %s rank %d (%s)", eng.instance_id, conn.rank, reason
            )

    async def _read(
        self, it: AsyncIterator[wpb.ConnectRequest], eng: InstanceEngine, conn: RankConn
    ) -> None:
        try:
            async for msg in it:
                if conn.closed:
                    # The instance was taken out under this stream: what it still sends belongs
                    # to a scheduler that is gone, and a report queued now would be applied to
                    # the instance's next scheduler (which never sent those tasks).
                    break
                conn.last_seen = time.monotonic()
                kind = msg.WhichOneof("kind")
                if kind == "report":
                    if conn.rank != 0:
                        raise ProtocolError(
                            f"rank {conn.rank} sent a StepReport; only rank 0 reports"
                        )
                    try:
                        report = codec.report_from_proto(msg.report)
                    except ValueError as exc:
                        raise ProtocolError(f"malformed StepReport: {exc}") from None
                    eng.submit_report(report)
                elif kind == "hello":
                    raise ProtocolError("second Hello on one stream")
                elif kind != "heartbeat":
                    raise ProtocolError("ConnectRequest must set hello, report or heartbeat")
        except ProtocolError as exc:
            log.warning(
                "instance %s rank %d broke the protocol: %s", eng.instance_id, conn.rank, exc
            )
            eng.take_out(f"protocol violation by rank {conn.rank}: {exc}", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # stream broken
            log.info("instance %s rank %d stream error: %r", eng.instance_id, conn.rank, exc)
        conn.queue.put_nowait(None)
