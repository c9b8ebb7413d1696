"""OTLP span encoding cost: microseconds per span of the library's encoder against ours.

    python -m bench.span_cost [--spans 512] [--rounds 20] [--json bench/results/span_cost.json]

Encodes batches of `--spans` spans shaped like the daemon's (one SERVER span per request: the
attributes the daemon sets (`kvsched.server.telemetry.spans._build`), the events queued, scheduled, first_token, finished, one
resource, one scope; every eighth span has a remote parent, a preemption and an error status)
with `opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans` (what the library's
OTLPSpanExporter runs on its batch thread, then SerializeToString in the gRPC stub) and with
`kvsched.server.telemetry.otlp.SpanEncoder` (which writes the request's bytes itself). Per encoder: the
median over `--rounds` batches of CPU time per span, to the request's bytes. Both encoders'
bytes are checked to be equal first.

Then the whole path, in this process as in the daemon: `--requests` requests through the
tracing hooks (kvsched.server.telemetry.tracing.Tracing: accept, scheduled, first token, finish), their
spans through the SDK's BatchSpanProcessor and the OTLP/gRPC exporter, library or ours, to a
`bench.otlp_sink` process, ~1,000 requests/s offered. Per exporter, alternated `--pipeline-runs`
times, medians of CPU per request: the hooks' (the event loop's thread in the daemon) and the
other threads' (the batch processor's thread encoding and exporting, gRPC's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from bench.transport_stack import last_match, machine, spawn
from kvsched.core import Events, FinishReason, Request, SamplingParams
from kvsched.core.slots import set_output
from kvsched.server.telemetry.otlp import KvschedSpanExporter, SpanEncoder
from kvsched.server.telemetry.spans import RequestEvents, RequestSpan
from kvsched.server.telemetry.tracing import Tracing

DEFAULT_JSON = Path(__file__).parent / "results" / "span_cost.json"


def daemon_spans(n: int, seed: int = 0) -> list[ReadableSpan]:
    """`n` spans as kvsched.server.telemetry.tracing builds them (same attribute and event shapes)."""
    rng = random.Random(seed)
    resource = Resource.create(
        {"service.version": "0.1.0", "service.instance.id": "ab" * 16, "kvsched.instances": ["i0"]}
    )
    scope = InstrumentationScope("kvsched", "0.1.0")
    sampled = TraceFlags(TraceFlags.SAMPLED)
    t0 = time.time_ns()
    spans = []
    for i in range(n):
        ctx = SpanContext(rng.getrandbits(128), rng.getrandbits(64), False, sampled)
        parent = SpanContext(ctx.trace_id, rng.getrandbits(64), True, sampled) if i % 8 else None
        where = {"kvsched.instance": "i0"}
        start = t0 + i * 1000
        events: list[tuple[str, Any, int]] = [
            ("queued", None, start),
            ("scheduled", where, start + 10_000),
            ("first_token", None, start + 30_000),
        ]
        status = Status(StatusCode.UNSET)
        reason = "length"
        if i % 8 == 7:
            events.append(("preempted", {**where, "kvsched.num_preemptions": 1}, start + 40_000))
            events.append(("resumed", where, start + 50_000))
            status, reason = Status(StatusCode.ERROR, "worker lost"), "error"
        end = start + 2_000_000
        events.append(("finished", {"kvsched.finish_reason": reason}, end))
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": "llama-3-8b",
            "gen_ai.request.max_tokens": 256,
            "gen_ai.response.id": f"t{seed}-{i}",  # unique, as the daemon's request ids
            "gen_ai.usage.input_tokens": rng.randrange(16, 2048),
            "gen_ai.usage.output_tokens": 256,
            "kvsched.cached_tokens": 0,
            "kvsched.num_preemptions": int(i % 8 == 7),
            "kvsched.instance": "i0",
            "gen_ai.response.finish_reasons": (reason,),
            "kvsched.queue_time_s": rng.random() * 1e-3,
            "kvsched.ttft_s": rng.random() * 1e-2,
        }
        spans.append(
            RequestSpan(
                "text_completion llama-3-8b",
                context=ctx,
                parent=parent,
                resource=resource,
                attributes=attrs,
                events=RequestEvents([x for e in events for x in e]),  # as the daemon's
                kind=SpanKind.SERVER,
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=scope,
            )
        )
    return spans


def per_span_us(
    fn: Callable[[Sequence[ReadableSpan]], Any], batches: list[list[ReadableSpan]]
) -> float:
    """Median CPU microseconds per span of `fn(batch)` over the batches (thread time). The
    batches differ (request ids, prompt lengths) as the daemon's do: an encoder that
    remembers values across batches gets no more hits than it would there."""
    times = []
    for spans in batches:
        t0 = time.thread_time()
        fn(spans)
        times.append((time.thread_time() - t0) * 1e6 / len(spans))
    return statistics.median(times)


def pipeline_run(exporter: str, endpoint: str, num_requests: int) -> tuple[float, float]:
    """CPU us per request of `num_requests` traced requests: (the hooks, on this thread; the
    other threads: the batch processor's, encoding and exporting, and gRPC's)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    cls = KvschedSpanExporter if exporter == "kvsched" else OTLPSpanExporter
    tracing = Tracing(TracerProvider(), "llama-3-8b")
    tracing.add_processor(BatchSpanProcessor(cls(endpoint=endpoint)))
    engine = SimpleNamespace(instance_id="i0")
    hooks = 0.0
    cpu0, main0 = time.process_time(), time.thread_time()
    for i in range(num_requests):
        req = Request(
            f"t{i}", [1] * 32, SamplingParams(max_tokens=256), arrival_time=time.monotonic()
        )
        set_output(req, [7] * 256)  # the span reads its length (output tokens)
        tr = SimpleNamespace(req=req, engine=engine, span=None)
        req.tag = tr
        t0 = time.thread_time()  # the hooks' CPU, not the fake request's making
        tracing.request_accepted(tr, {})
        req.first_scheduled_time = time.monotonic()
        tracing.lifecycle(engine, Events(scheduled=[req]))
        req.first_token_time, req.num_cached_tokens = time.monotonic(), 0
        tracing.lifecycle(engine, Events(first_token=[req]))
        req.finish_reason, req.finished_time = FinishReason.LENGTH, time.monotonic()
        tracing.request_finished(tr)
        hooks += time.thread_time() - t0
        if i % 50 == 49:
            time.sleep(0.05)  # ~1,000 requests/s offered, as a busy daemon finishes them
    main = time.thread_time() - main0
    tracing.shutdown()  # exports what is left, on the batch thread
    others = time.process_time() - cpu0 - main
    return hooks * 1e6 / num_requests, others * 1e6 / num_requests


def pipeline(num_requests: int, runs: int) -> list[dict[str, Any]]:
    sink = spawn("otlp-sink", ["-m", "bench.otlp_sink", "--listen", "127.0.0.1:0"], {})
    try:
        endpoint = "http://" + sink.wait_for(r"otlp sink listening on (\S+:\d+)").group(1)
        got: dict[str, list[tuple[float, float]]] = {"library": [], "kvsched": []}
        for _ in range(runs):
            for name in got:
                got[name].append(pipeline_run(name, endpoint, num_requests))
    finally:
        sink.stop()
    time.sleep(0.2)
    m = last_match(sink, r"otlp sink: \d+ export requests, (\d+) spans")
    received = int(m.group(1)) if m else 0
    if received != 2 * runs * num_requests:
        raise SystemExit(f"the sink received {received} spans, not {2 * runs * num_requests}")
    records = []
    print(f"\ntracing path per request ({num_requests} requests, median of {runs} runs)")
    print(f"{'exporter':>8} {'hooks us':>9} {'export threads us':>18} {'total us':>9}")
    for name, rs in got.items():
        hooks = statistics.median(r[0] for r in rs)
        others = statistics.median(r[1] for r in rs)
        print(f"{name:>8} {hooks:>9,.1f} {others:>18,.1f} {hooks + others:>9,.1f}")
        records.append(
            {
                "exporter": name,
                "requests": num_requests,
                "runs": runs,
                "hooks_cpu_us_per_request": round(hooks, 1),
                "export_threads_cpu_us_per_request": round(others, 1),
            }
        )
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spans", type=int, default=512, help="spans per batch (the SDK's max batch)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=4096, help="per pipeline run")
    ap.add_argument("--pipeline-runs", type=int, default=3, help="0: skip the pipeline")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    args = ap.parse_args()
    batches = [daemon_spans(args.spans, seed) for seed in range(args.rounds)]
    spans = batches[0]
    ours = SpanEncoder()
    if ours.encode(spans) != encode_spans(spans).SerializeToString():
        raise SystemExit("the encoders disagree: run tests/server/test_otlp_encode.py")
    cases: dict[str, Callable[[Sequence[ReadableSpan]], bytes]] = {
        "library": lambda s: encode_spans(s).SerializeToString(),
        "kvsched": ours.encode,  # writes the bytes itself
    }
    print(f"OTLP encoding of {args.spans} daemon-shaped spans, median of {args.rounds} batches")
    print(f"machine: {machine()}")
    print(f"{'encoder':>8} {'to request bytes us/span':>25}")
    records = []
    for name, fn in cases.items():
        total = per_span_us(fn, batches)
        print(f"{name:>8} {total:>25,.1f}")
        records.append(
            {"encoder": name, "spans": args.spans, "encode_serialize_us_per_span": round(total, 2)}
        )
    speedup = (
        records[0]["encode_serialize_us_per_span"] / records[1]["encode_serialize_us_per_span"]
    )
    print(f"kvsched's encoder: {speedup:.1f}x faster to bytes")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "encoders": records,
    }
    if args.pipeline_runs:
        result["pipeline"] = pipeline(args.requests, args.pipeline_runs)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
