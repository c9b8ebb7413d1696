"""kvsched.server.telemetry.otlp's span encoder gives the library's `encode_spans` request, message for
message: for the spans the daemon's tracing hooks make, and for span shapes the SDK allows
beyond them (every attribute type, links, dropped counts, several resources and scopes)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from kvsched.core import Events, FinishReason, Request, SamplingParams
from kvsched.core.slots import set_output
from kvsched.server.telemetry.otlp import KvschedSpanExporter, SpanEncoder
from kvsched.server.telemetry.spans import MAX_EVENTS, RequestEvents, RequestSpan
from kvsched.server.telemetry.tracing import Tracing

from .telemetry_harness import OtlpReceiver

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


class Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def assert_same_request(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """Our encoder's bytes are the library's request serialized, byte for byte."""
    ours, library = SpanEncoder().encode(spans), encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(ours) == library
    assert ours == library.SerializeToString(deterministic=True)
    return library


def daemon_spans() -> list[ReadableSpan]:
    """Spans from the daemon's own hooks: a client's traceparent + tracestate or none, first
    token, preemption, a lost instance, error / length / abort finishes, one open at shutdown."""
    keep = Keep()
    tracing = Tracing(TracerProvider(resource=Resource.create({"kvsched.instances": ["i0"]})), "m")
    tracing.add_processor(keep)
    engine = SimpleNamespace(instance_id="i0")
    trs = []
    for i in range(6):
        req = Request(
            f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=time.monotonic()
        )
        tr = SimpleNamespace(req=req, engine=engine, instance_id="i0", span=None)
        req.tag = tr
        carrier = {}
        if i % 2:
            carrier = {
                "traceparent": f"00-{TRACE_ID:032x}-{i + 1:016x}-01",
                "tracestate": "k=v,a=1",
            }
        tracing.request_accepted(tr, carrier)
        trs.append(tr)
    reqs = [tr.req for tr in trs]
    for req in reqs:
        req.first_scheduled_time = time.monotonic()
    tracing.lifecycle(engine, Events(scheduled=reqs[:5]))
    for req in reqs[:4]:
        req.first_token_time = time.monotonic()
        set_output(req, [5, 6])
        req.num_cached_tokens = 0
    tracing.lifecycle(engine, Events(first_token=reqs[:4]))
    reqs[1].num_preemptions = 1
    tracing.lifecycle(engine, Events(preempted=[reqs[1]]))
    tracing.request_moved(trs[2], "worker stream ended")
    tracing.lifecycle(engine, Events(scheduled=[reqs[1], reqs[2]]))
    finishes = [FinishReason.LENGTH, FinishReason.STOP, FinishReason.ERROR, FinishReason.ABORT]
    for tr, reason in zip(trs, finishes, strict=False):
        tr.req.finish_reason = reason
        tr.req.finish_message = "worker lost" if reason == FinishReason.ERROR else ""
        tr.req.finished_time = time.monotonic()
        tracing.request_finished(tr)
    tracing.end_open(trs[4:])
    assert len(keep.spans) == 6
    return keep.spans


def test_the_daemons_spans_encode_as_the_library_encodes_them() -> None:
    spans = daemon_spans()
    request = assert_same_request(spans)
    (rs,) = request.resource_spans
    (ss,) = rs.scope_spans
    assert len(ss.spans) == 6 and ss.scope.name == "kvsched"
    assert ss.spans[2].status.code == ss.spans[2].status.STATUS_CODE_ERROR
    assert ss.spans[1].trace_state == "k=v,a=1" and ss.spans[1].parent_span_id


def span(
    i: int,
    resource: Resource,
    scope: InstrumentationScope | None,
    attributes: Any = None,
    **kwargs: Any,
) -> ReadableSpan:
    ctx = SpanContext(TRACE_ID + i, 0x100 + i, False, SAMPLED, TraceState([("k", str(i))]))
    return ReadableSpan(
        f"s{i}",
        context=ctx,
        resource=resource,
        instrumentation_scope=scope,
        attributes=attributes,
        start_time=1_000 + i,
        end_time=2_000 + i,
        **kwargs,
    )


ALL_TYPES: dict[str, Any] = {
    "s": "x",
    "empty": "",
    "i": -3,
    "big": 2**62,
    "f": 0.25,
    "b": True,
    "false": False,
    "bytes": b"\x00\x01",
    "strs": ("a", "b"),
    "ints": [1, 2, 3],
    "floats": (0.5, -1.0),
    "bools": [True, False],
    "no items": (),
    "mapping": {"k": 1, "n": {"deep": "v"}},
    "none": None,
}


def test_every_attribute_type_links_kinds_and_dropped_counts() -> None:
    res = Resource({"service.name": "svc", "list": ["a", "b"]}, "https://schema/r")
    scope = InstrumentationScope("lib", "1.0", "https://schema/s", {"scope.attr": 7})
    bounded = BoundedAttributes(maxlen=2, attributes={"a": 1, "b": "2", "c": 3.0}, immutable=False)
    link_ctx = SpanContext(TRACE_ID, 0xABC, True, SAMPLED)
    events = BoundedList.from_seq(1, [Event("e1", ALL_TYPES, 5), Event("e2", bounded, 6)])
    spans = [
        span(0, res, scope, ALL_TYPES, kind=SpanKind.SERVER, events=[Event("e", None, 3)]),
        span(
            1,
            res,
            scope,
            bounded,
            kind=SpanKind.CLIENT,
            parent=SpanContext(TRACE_ID, 0x55, False, SAMPLED),
            links=[Link(link_ctx, {"l": "v"}), Link(link_ctx)],
            status=Status(StatusCode.OK),
        ),
        span(
            2,
            res,
            None,
            kind=SpanKind.PRODUCER,
            events=events,
            links=BoundedList.from_seq(1, [Link(link_ctx), Link(link_ctx)]),
            status=Status(StatusCode.ERROR, "bad"),
        ),
        span(3, res, scope, kind=SpanKind.CONSUMER),
        span(4, res, scope, {"bad": object(), "ok": 1, "huge": 2**64, "deep": [object()]}),
    ]
    assert_same_request(spans)


def test_resources_and_scopes_group_as_the_library_groups_them() -> None:
    """Grouping by equality: equal resources / scopes held in distinct objects share one entry,
    in the order each first appears in the batch."""
    r1, r2 = Resource({"service.name": "a"}), Resource({"service.name": "b"})
    r1_again = Resource({"service.name": "a"})
    s1, s2 = InstrumentationScope("x", "1"), InstrumentationScope("y")
    s1_again = InstrumentationScope("x", "1")
    order = [(r1, s1), (r2, s1), (r1_again, s2), (r1, None), (r2, s1_again), (r1, s1_again)]
    spans = [span(i, r, s, {"n": i}) for i, (r, s) in enumerate(order)]
    request = assert_same_request(spans)
    assert [len(rs.scope_spans) for rs in request.resource_spans] == [3, 1]
    assert assert_same_request(spans[::-1]) is not None
    assert_same_request([])


def test_encodings_are_reused_across_batches_without_mixing_objects_up() -> None:
    encoder = SpanEncoder()
    for i in range(40):  # more resources than the cache keeps: it starts over
        res = Resource({"service.name": f"svc{i}"})
        spans = [span(j, res, InstrumentationScope(f"lib{i}"), {"n": j}) for j in range(3)]
        assert encoder.encode(spans) == encode_spans(spans).SerializeToString()
        assert encoder.encode(spans) == encode_spans(spans).SerializeToString()


def test_the_exporter_sends_the_encoders_bytes_to_a_real_receiver() -> None:
    """The request goes out as the encoder wrote it, also on the client the library makes
    again after an UNAVAILABLE error; the receiver parses the library's request."""
    receiver = OtlpReceiver()
    exporter = KvschedSpanExporter(endpoint=f"http://127.0.0.1:{receiver.port}", headers={"k": "v"})
    try:
        spans = daemon_spans()
        assert exporter._translate_data(spans) == encode_spans(spans).SerializeToString()
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        exporter._channel.close()  # what the library does on UNAVAILABLE, then:
        exporter._initialize_channel_and_stub()
        assert exporter.export(spans[:2]) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
        receiver.stop()
    assert receiver.requests == [encode_spans(spans), encode_spans(spans[:2])]
    assert receiver.metadata[1]["k"] == "v"


def test_remembered_attribute_fields_keep_equal_values_of_other_types_apart() -> None:
    """The encoder remembers (key, value) fields across spans: 1 == True == 1.0 must not
    share one, nor tuples of them; unhashable items are encoded, not remembered."""
    res, scope = Resource({}), InstrumentationScope("x")
    values: list[Any] = [1, True, 1.0, "1", (1,), (True,), (1.0,), ("1",), [1], (1, [2]), 0, False]
    encoder = SpanEncoder()
    for rounds in range(2):  # the second round meets what the first remembered
        for i, v in enumerate(values):
            spans = [span(i, res, scope, {"v": v}, events=[Event("e", {"v": v}, 1)])]
            assert encoder.encode(spans) == encode_spans(spans).SerializeToString(), (rounds, v)


def test_request_span_events_are_made_only_when_read() -> None:
    """The daemon's spans carry their events as the trace's flat list: the encoder reads that,
    anyone else gets ordinary SDK Events with the same content."""
    spans = daemon_spans()
    SpanEncoder().encode(spans)
    assert all(isinstance(s.events, RequestEvents) and s.events._events is None for s in spans)
    assert all(isinstance(s, RequestSpan) for s in spans)
    request = assert_same_request(spans)  # the library reads them as Events
    for s, pb in zip(spans, request.resource_spans[0].scope_spans[0].spans, strict=True):
        events = s.events
        assert isinstance(events, RequestEvents)
        triples = list(events.triples())
        assert len(events) == len(triples) == len(pb.events) >= 2
        assert [e.name for e in events] == [e.name for e in pb.events] == [t[0] for t in triples]
        assert events[0] is events[0] and isinstance(events[-1], Event)
        assert [e.timestamp for e in events[1:]] == [t[2] for t in triples[1:]]
        assert [e.attributes for e in events] == [t[1] for t in triples]
        assert json.loads(s.to_json())["events"][0]["name"] == "queued"  # the console's view


def test_a_trace_keeps_at_most_max_events_then_its_last() -> None:
    tracing = Tracing(TracerProvider(), "m")
    keep = Keep()
    tracing.add_processor(keep)
    req = Request("r", [1], SamplingParams(max_tokens=1), arrival_time=time.monotonic())
    tr = SimpleNamespace(req=req, instance_id="i0", span=None)
    req.tag = tr
    tracing.request_accepted(tr, {})
    for _ in range(MAX_EVENTS + 5):
        tracing.request_moved(tr, "worker stream ended")
    req.finish_reason, req.finished_time = FinishReason.ABORT, time.monotonic()
    tracing.request_finished(tr)
    (span,) = keep.spans
    names = [e.name for e in span.events]
    assert len(names) == MAX_EVENTS + 1 and names[0] == "queued" and names[-1] == "finished"
    assert names[1:-1] == ["instance_lost"] * (MAX_EVENTS - 1)
    assert dict(span.events[-1].attributes or {}) == {"kvsched.finish_reason": "abort"}
    assert_same_request(keep.spans)
