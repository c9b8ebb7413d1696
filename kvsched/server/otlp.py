"""The OTLP/gRPC span exporter, with an encoder sized for our spans.

The library's exporter encodes each batch with `encode_spans` (opentelemetry-exporter-otlp-
proto-common), which builds every span, event, attribute and value as a keyword-constructed
protobuf message and hashes each span's Resource (a JSON dump of its attributes) to group the
batch: 55-97 us per span of ours, on the batch processor's thread, holding the GIL the daemon's
event loop needs (docs/BENCHMARKS.md section 3, bench/span_cost.py). Our spans have a fixed
shape: one SERVER span per request, a handful of events, scalar or tuple attributes, one
resource and one scope per daemon. `SpanEncoder` fills the request message in place instead
(~18 us per span), grouping by object identity (with an equality check only when a batch meets
a new Resource or scope object) and keeping each resource's and scope's encoding across
batches. Its output equals the library's, message for message, for the daemon's spans and the
other shapes the SDK allows (tests/server/test_otlp_encode.py); everything else (endpoint,
headers, TLS, compression, retries, OTEL_EXPORTER_OTLP_* variables) stays the library's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope as PBScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PBResource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope as SDKScope
from opentelemetry.trace import SpanContext, SpanKind

log = logging.getLogger("kvsched.tracing")

_KIND = {
    SpanKind.INTERNAL: Span.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: Span.SPAN_KIND_SERVER,
    SpanKind.CLIENT: Span.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: Span.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: Span.SPAN_KIND_CONSUMER,
}
_HAS_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_MAX_CACHED = 16  # resources / scopes whose encoding is kept; a daemon has one of each


class KvschedSpanExporter(OTLPSpanExporter):
    """The library's OTLP/gRPC span exporter with `SpanEncoder` as its encoder."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = SpanEncoder()

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return self._encoder.encode(data)


class SpanEncoder:
    """Spans to one ExportTraceServiceRequest, as the library's `encode_spans` makes it:
    resource_spans in the order their Resource first appears in the batch, scope_spans
    likewise within each, spans in batch order; resources and scopes that compare equal
    share one entry. Calls may overlap (a flush beside the batch thread): a batch's state is
    local to its call, and a cache entry is only used for the very object it was made from."""

    def __init__(self) -> None:
        # id -> (the object, its encoding): the object is held so its id stays unique
        self._resources: dict[int, tuple[Any, bytes]] = {}
        self._scopes: dict[int, tuple[Any, bytes]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        request = ExportTraceServiceRequest()
        batch = _Batch(request)
        # (id(resource), id(scope)) -> where spans of that pair go; the batch holds the objects
        groups: dict[tuple[int, int], Any] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope or None
            out = groups.get((id(resource), id(scope)))
            if out is None:
                out = groups[(id(resource), id(scope))] = self._scope_spans(batch, resource, scope)
            fill_span(out.add(), span)
        return request

    def _scope_spans(self, batch: _Batch, resource: Resource, scope: SDKScope | None) -> Any:
        """The repeated `spans` field of the request's ScopeSpans for (resource, scope), added
        unless an equal pair's is there already (the library groups by equality)."""
        entry = next((e for e in batch.resources if e[0] == resource), None)
        if entry is None:
            rs = batch.request.resource_spans.add()
            rs.resource.SetInParent()
            rs.resource.MergeFromString(self._encoded(self._resources, resource))
            rs.schema_url = resource.schema_url or ""
            entry = (resource, rs, [])
            batch.resources.append(entry)
        _, rs, scopes = entry
        for sc, spans in scopes:
            if sc == scope:
                return spans
        ss = rs.scope_spans.add()
        ss.scope.SetInParent()
        ss.scope.MergeFromString(self._encoded(self._scopes, scope))
        if scope is not None and scope.schema_url:
            ss.schema_url = scope.schema_url
        scopes.append((scope, ss.spans))
        return ss.spans

    @staticmethod
    def _encoded(cache: dict[int, tuple[Any, bytes]], obj: Resource | SDKScope | None) -> bytes:
        """`obj`'s Resource / InstrumentationScope message, serialized, from `cache` when there."""
        hit = cache.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        if isinstance(obj, Resource):
            pb: Any = PBResource()
        else:
            pb = PBScope()
            if obj is not None:
                pb.name = obj.name
                if obj.version:
                    pb.version = obj.version
        if obj is not None and obj.attributes:
            fill_attributes(pb.attributes, obj.attributes)
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        encoded: bytes = pb.SerializeToString()
        cache[id(obj)] = (obj, encoded)
        return encoded


class _Batch:
    """One encode call's request and the resources and scopes it has entries for."""

    __slots__ = ("request", "resources")

    def __init__(self, request: ExportTraceServiceRequest) -> None:
        self.request = request
        self.resources: list[tuple[Resource, Any, list[tuple[SDKScope | None, Any]]]] = []


def fill_span(pb: Span, span: ReadableSpan) -> None:
    """Set `pb` to the library's encoding of `span`."""
    ctx = span.context
    pb.trace_id = ctx.trace_id.to_bytes(16, "big")
    pb.span_id = ctx.span_id.to_bytes(8, "big")
    if ctx.trace_state:
        pb.trace_state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    parent: SpanContext | None = span.parent
    flags: int = _HAS_IS_REMOTE
    if parent:
        pb.parent_span_id = parent.span_id.to_bytes(8, "big")
        if parent.is_remote:
            flags |= _IS_REMOTE
    pb.flags = flags
    pb.name = span.name
    pb.kind = _KIND[span.kind]
    pb.start_time_unix_nano = span.start_time or 0
    pb.end_time_unix_nano = span.end_time or 0
    if span.attributes:
        fill_attributes(pb.attributes, span.attributes)
    for event in span.events:
        ev = pb.events.add()
        ev.name = event.name
        ev.time_unix_nano = event.timestamp
        if attributes := event.attributes:
            fill_attributes(ev.attributes, attributes)
        if dropped := event.dropped_attributes:
            ev.dropped_attributes_count = dropped
    for link in span.links:
        lk = pb.links.add()
        lk.trace_id = link.context.trace_id.to_bytes(16, "big")
        lk.span_id = link.context.span_id.to_bytes(8, "big")
        lk.flags = _HAS_IS_REMOTE | (_IS_REMOTE if link.context.is_remote else 0)
        if link.attributes:
            fill_attributes(lk.attributes, link.attributes)
        if dropped := link.dropped_attributes:
            lk.dropped_attributes_count = dropped
    status = span.status
    pb.status.SetInParent()
    pb.status.code = status.status_code.value  # type: ignore[assignment]
    if status.description:
        pb.status.message = status.description
    if dropped := span.dropped_attributes:
        pb.dropped_attributes_count = dropped
    if dropped := span.dropped_events:
        pb.dropped_events_count = dropped
    if dropped := span.dropped_links:
        pb.dropped_links_count = dropped


def fill_attributes(out: Any, attributes: Mapping[str, Any]) -> None:
    """Append `attributes` to the repeated KeyValue field `out`."""
    for key, value in attributes.items():
        kv = out.add()
        kv.key = key
        try:
            fill_value(kv.value, value)
        except Exception:  # as the library does: log, drop this attribute, keep the rest
            log.exception("OTLP: cannot encode attribute %s", key)
            del out[-1]


def fill_value(pb: AnyValue, value: Any) -> None:
    t = type(value)  # exact types first: the common case, without isinstance's ABC checks
    if t is str:
        pb.string_value = value
    elif t is int:
        pb.int_value = value
    elif t is float:
        pb.double_value = value
    elif t is bool:
        pb.bool_value = value
    elif t is tuple or t is list:
        _fill_array(pb, value)
    elif value is None:
        pb.SetInParent()
    # subclasses, in the library's order: bool before int, str and bytes before Sequence
    elif isinstance(value, bool):
        pb.bool_value = value
    elif isinstance(value, str):
        pb.string_value = value
    elif isinstance(value, int):
        pb.int_value = value
    elif isinstance(value, float):
        pb.double_value = value
    elif isinstance(value, bytes):
        pb.bytes_value = value
    elif isinstance(value, Sequence):
        _fill_array(pb, value)
    elif isinstance(value, Mapping):
        pb.kvlist_value.SetInParent()
        kvs = pb.kvlist_value.values
        for k, v in value.items():
            kv = kvs.add()
            kv.key = str(k)
            fill_value(kv.value, v)
    else:
        raise TypeError(f"invalid attribute value type {t.__name__}")


def _fill_array(pb: AnyValue, values: Sequence[Any]) -> None:
    pb.array_value.SetInParent()  # present even when empty, as the library has it
    out = pb.array_value.values
    for v in values:
        fill_value(out.add(), v)
