"""The daemon's request spans for the replay benches (`bench.tier_compare`, `bench.send_cost`):
an OTLP receiver on loopback (`SpanSink`) and a replay cluster started to export to it
(`traced_cluster`)."""

from __future__ import annotations

import os
import threading
from concurrent import futures
from typing import Any
from unittest import mock

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvsched.replay.launch import start_cluster


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps, per request id, its span's attributes and its host_cache_hit event's."""

    def __init__(self) -> None:
        self.spans: dict[str, dict[str, Any]] = {}
        self.cond = threading.Condition()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.cond:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {a.key: _value(a.value) for a in span.attributes}
                        attrs["arrival_ns"] = span.start_time_unix_nano  # the daemon's clock
                        for ev in span.events:
                            if ev.name == "first_token":
                                attrs["first_token_ns"] = ev.time_unix_nano
                            if ev.name == "host_cache_hit":
                                attrs.update({a.key: _value(a.value) for a in ev.attributes})
                        self.spans[str(attrs.get("gen_ai.response.id"))] = attrs
            self.cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, n: int, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.spans) >= n, timeout_s)


def traced_cluster(
    instances: int, extra_env: dict[str, str] | None = None, **cluster_args: Any
) -> tuple[SpanSink, grpc.Server, Any]:
    """An OTLP span sink on loopback, and a replay cluster whose daemon exports to it (the OTel
    variables and `extra_env` set only while its processes start); the sink stops on failure."""
    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        **(extra_env or {}),
    }
    try:
        with mock.patch.dict(os.environ, env):  # (restored after: the processes inherit them)
            cluster = start_cluster(instances, **cluster_args)
    except BaseException:
        server.stop(None)
        raise
    return sink, server, cluster
