"""A worker written by hand on one raw Connect stream: the test decides every message it sends
and sees every message the daemon sends (tasks, heartbeats), for checks the reference worker
would hide."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvsched.codec import PROTOCOL_VERSION
from kvsched.v1 import worker_service_pb2 as wpb
from kvsched.v1 import worker_service_pb2_grpc


def hello(instance: str, rank: int = 0, world_size: int = 1, **fields: Any) -> wpb.Hello:
    h = dict(num_gpu_blocks=64, block_size=16, num_slots=8, model="model-a")
    h.update(fields)
    return wpb.Hello(
        instance_id=instance,
        rank=rank,
        world_size=world_size,
        protocol_version=PROTOCOL_VERSION,
        **h,
    )


class RawWorker:
    """One Connect stream written by hand. Records the seq of every Tasks message and counts
    the daemon's heartbeats."""

    def __init__(self, channel: grpc.aio.Channel, first: wpb.Hello) -> None:
        self._out: asyncio.Queue[wpb.ConnectRequest | None] = asyncio.Queue()
        self._out.put_nowait(wpb.ConnectRequest(hello=first))
        self.call = worker_service_pb2_grpc.WorkerServiceStub(channel).Connect(self._requests())
        self.seqs: list[int] = []
        self.heartbeats = 0
        self.step = 0
        self.applied = 0

    async def _requests(self):
        while (msg := await self._out.get()) is not None:
            yield msg

    async def read(self, kind: str, timeout: float = 10.0) -> Any:
        """The next message of `kind` ('welcome', 'tasks', 'heartbeat'); others are recorded
        and skipped."""
        while True:
            msg = await asyncio.wait_for(self.call.read(), timeout)
            assert msg is not grpc.aio.EOF, f"stream ended waiting for {kind}"
            got = msg.WhichOneof("kind")
            if got == "tasks":
                self.seqs.append(msg.tasks.seq)
            elif got == "heartbeat":
                self.heartbeats += 1
            if got == kind:
                return getattr(msg, kind)

    async def tasks_where(self, pred: Any, timeout: float = 10.0) -> wpb.Tasks:
        """The next Tasks message for which `pred` holds; applies the ones skipped."""
        while True:
            t = await self.read("tasks", timeout)
            self.applied = t.seq
            if pred(t):
                return t

    def report(self, **cols: Any) -> None:
        """A StepReport for the next step, having applied every Tasks message read so far."""
        self.step += 1
        rep = wpb.StepReport(step=self.step, applied_seq=self.applied, **cols)
        self._out.put_nowait(wpb.ConnectRequest(report=rep))

    def close(self) -> None:
        self._out.put_nowait(None)
        self.call.cancel()


async def read_all(call: Any) -> list[Any]:
    """The rest of a stream already read with read() (the two styles do not mix)."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out
