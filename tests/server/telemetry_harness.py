"""Real parts for the telemetry tests: an OTLP/gRPC trace receiver, and a daemon with an
in-process sim worker (the reference `Worker` client) over a real loopback gRPC channel."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otel_common
from opentelemetry.proto.trace.v1 import trace_pb2

from kvsched.daemon import app as daemon_mod
from kvsched.server.config.load import load_config
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.worker_stub.client import Worker, sim_engine_factory


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A TraceService on 127.0.0.1:0 keeping every ExportTraceServiceRequest it gets. A
    thread-pool server, so a daemon flushing from the event loop's thread can reach it."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            self.requests.append(request)
            self.metadata.append({k: v for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict[str, Any], trace_pb2.Span]]:
        """(resource attributes, span) for every span received."""
        out = []
        with self._lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    res = attributes(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        out.extend((res, span) for span in ss.spans)
        return out

    def stop(self) -> None:
        self.server.stop(None)


def any_value(v: otel_common.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finished: rpb.Finished | None = None


def request(req_id: str, prompt_len: int, max_tokens: int, seed: int = 0) -> rpb.GenerateRequest:
    prompt = [3 + (seed * 7919 + i * 31) % 30000 for i in range(prompt_len)]
    return rpb.GenerateRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


class Harness:
    """A daemon (in this process, its gRPC server on loopback) and one sim worker per instance."""

    def __init__(self, daemon: daemon_mod.Daemon, port: int, workers: dict[str, Worker]) -> None:
        self.daemon = daemon
        self.port = port
        self.workers = workers
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = request_service_pb2_grpc.RequestServiceStub(self.channel)
        loop = asyncio.get_running_loop()
        self.tasks = {iid: loop.create_task(w.run()) for iid, w in workers.items()}

    async def wait_ready(self, timeout: float = 10.0) -> None:
        async def ready() -> None:
            engines = self.daemon.engines
            while not all(iid in engines and engines[iid].ready for iid in self.workers):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(ready(), timeout)

    async def generate(
        self, msg: rpb.GenerateRequest, metadata: tuple[tuple[str, str], ...] = ()
    ) -> Result:
        out = Result()
        async for r in self.stub.Generate(msg, metadata=metadata):
            kind = r.WhichOneof("kind")
            if kind == "tokens":
                out.tokens.extend(r.tokens.token_ids)
            elif kind == "finished":
                out.finished = r.finished
        return out

    async def stop_worker(self, instance_id: str = "i0") -> None:
        """Stop the worker and wait until the daemon has taken its instance out: the worker's
        task ends when it has closed its side, which can be before the daemon has read that,
        and a test that then closes its client channel would see its requests aborted by the
        dropped streams instead of lost with their instance."""
        self.workers[instance_id].stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.tasks[instance_id], 10.0)
        eng = self.daemon.engines.get(instance_id)

        async def taken_out() -> None:
            while eng is not None and eng.ready:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(taken_out(), 10.0)


@contextlib.asynccontextmanager
async def running_daemon(
    overrides: dict[str, Any],
    num_gpu_blocks: int = 512,
    block_size: int = 16,
    num_slots: int = 16,
    zero_cost: bool = True,
    instances: tuple[str, ...] = ("i0",),
    num_host_blocks: int = 0,
    speed: float = 1.0,
) -> AsyncIterator[Harness]:
    """Yield a Harness; on exit stop the workers and the server, then shut telemetry down
    (which flushes the span exporters)."""
    config = load_config(None, {}, {"listen": "127.0.0.1:0", "metrics_listen": "", **overrides})
    daemon = daemon_mod.Daemon(config)
    server = daemon_mod.build_server(daemon, config)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    workers = {
        iid: Worker(
            f"127.0.0.1:{port}",
            iid,
            sim_engine_factory(num_slots, zero_cost=zero_cost, speed=speed),
            num_gpu_blocks=num_gpu_blocks,
            num_host_blocks=num_host_blocks,
            block_size=block_size,
            num_slots=num_slots,
            reconnect_backoff_s=(0.01, 0.05),
        )
        for iid in instances
    }
    h = Harness(daemon, port, workers)
    try:
        await h.wait_ready()
        yield h
    finally:
        for iid in instances:
            await h.stop_worker(iid)
        await h.channel.close()
        await server.stop(None)
        daemon.close_telemetry()
