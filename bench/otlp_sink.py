"""A standalone OTLP/gRPC trace receiver for benchmarks: counts what it is sent, keeps nothing.

    python -m bench.otlp_sink [--listen 127.0.0.1:0]

Prints `otlp sink listening on HOST:PORT` once serving, and on SIGTERM / SIGINT a last line
`otlp sink: N export requests, M spans, B bytes`. A separate process (not the test harness's
in-process receiver) so that the daemon under test exports over a real socket to a peer whose
CPU is not charged to the daemon.
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class CountingSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.num_requests = 0
        self.num_spans = 0
        self.num_bytes = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.num_requests += 1
            self.num_spans += spans
            self.num_bytes += request.ByteSize()
        return trace_service_pb2.ExportTraceServiceResponse()

    def summary(self) -> str:
        with self._lock:
            return (
                f"otlp sink: {self.num_requests} export requests, {self.num_spans} spans, "
                f"{self.num_bytes} bytes"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    args = ap.parse_args()
    sink = CountingSink()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port(args.listen)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    host = args.listen.rpartition(":")[0]
    print(f"otlp sink listening on {host}:{port}", flush=True)
    stop.wait()
    server.stop(1.0).wait()
    print(sink.summary(), flush=True)


if __name__ == "__main__":
    main()
