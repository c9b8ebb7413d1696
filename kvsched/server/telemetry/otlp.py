"""The OTLP/gRPC span exporter, with an encoder sized for our spans.

The library's exporter encodes each batch with `encode_spans` (opentelemetry-exporter-otlp-
proto-common), which builds every span, event, attribute and value as a keyword-constructed
protobuf message and hashes each span's Resource (a JSON dump of its attributes) to group the
batch: 55-97 us per span of ours, on the batch processor's thread, holding the GIL the daemon's
event loop needs (docs/BENCHMARKS.md section 3, bench/span_cost.py). Our spans have a fixed
shape: one SERVER span per request, a handful of events, scalar or tuple attributes, one
resource and one scope per daemon. `SpanEncoder` writes the request's protobuf bytes itself
(~11 us per span, against ~17 us for filling the message in place and serializing it, the
previous version): most of a span's attributes repeat from request to request (model,
operation, instance, finish reason), so their encoded fields are remembered and a hit is one
dict lookup. It groups by object identity (with an equality check only when a batch meets a
new Resource or scope object) and keeps each resource's and scope's encoding across batches.
Its bytes equal the library's serialized request, byte for byte, for the daemon's spans and
the other shapes the SDK allows (tests/server/test_otlp_encode.py); the gRPC stub sends them
as they are (the protobuf writing is `otlp_wire`'s). Everything else (endpoint, headers, TLS, compression, retries,
OTEL_EXPORTER_OTLP_* variables) stays the library's.

One span as OTLP protobuf bytes, written by hand (`encode_span`), and the fields a Resource
or InstrumentationScope message is made of (`delimited`, `resource_attributes`,
`scope_attributes`): the wire-format half of `otlp.SpanEncoder`, whose bytes equal the
library's serialized request byte for byte (tests/server/test_otlp_encode.py). Encoded
attribute fields and names that repeat from span to span are remembered (bounded caches).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Span, SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope as SDKScope
from opentelemetry.trace import SpanContext, SpanKind

from kvsched.server.telemetry.spans import RequestEvents

log = logging.getLogger("kvsched.tracing")

# ---- protobuf wire format -----------------------------------------------------------------
# Fields are written in field-number order and proto3 defaults (0, "", b"") are left out, as
# the protobuf runtime serializes them; a oneof member (AnyValue's) is written even when it
# holds its default, and a message field the library sets is written even when empty.

_BYTE = [bytes((i,)) for i in range(256)]
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _varint(n: int) -> bytes:
    """Base-128 varint of 0 <= n < 2**64 (negative int64s are passed as n + 2**64)."""
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: tag, length, body."""
    n = len(body)
    return tag + (_BYTE[n] if n < 0x80 else _varint(n)) + body


_KIND = {
    SpanKind.INTERNAL: b"\x30" + _BYTE[Span.SPAN_KIND_INTERNAL],
    SpanKind.SERVER: b"\x30" + _BYTE[Span.SPAN_KIND_SERVER],
    SpanKind.CLIENT: b"\x30" + _BYTE[Span.SPAN_KIND_CLIENT],
    SpanKind.PRODUCER: b"\x30" + _BYTE[Span.SPAN_KIND_PRODUCER],
    SpanKind.CONSUMER: b"\x30" + _BYTE[Span.SPAN_KIND_CONSUMER],
}
# Span.flags (field 16, fixed32): the parent's is-remote bit is known for every span
_FLAGS_LOCAL = b"\x85\x01" + _fixed32(SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
_FLAGS_REMOTE = b"\x85\x01" + _fixed32(
    SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
)
_LINK_FLAGS_LOCAL = b"\x35" + _FLAGS_LOCAL[2:]
_LINK_FLAGS_REMOTE = b"\x35" + _FLAGS_REMOTE[2:]


def encode_span(span: ReadableSpan) -> bytes:
    """ScopeSpans.spans entry (tag, length, Span) for `span`, as the library encodes it."""
    ctx = span.context
    parts = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big")]
    parts.append(b"\x12\x08" + ctx.span_id.to_bytes(8, "big"))
    if ctx.trace_state:
        state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
        parts.append(delimited(b"\x1a", state.encode()))
    parent: SpanContext | None = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    if name := span.name:
        parts.append(_span_name(name))
    parts.append(_KIND[span.kind])
    if start := span.start_time:
        parts.append(b"\x39" + _fixed64(start))
    if end := span.end_time:
        parts.append(b"\x41" + _fixed64(end))
    if attributes := span.attributes:
        _span_attributes(parts, attributes)
    if dropped := span.dropped_attributes:
        parts.append(b"\x50" + _varint(dropped))
    events = span.events
    if type(events) is RequestEvents:  # the daemon's: plain values, mapping or no attributes
        for name, attributes, ts in events.triples():
            ev = [b"\x09" + _fixed64(ts)] if ts else []
            if name:
                ev.append(_event_name(name))
            if attributes:
                _event_attributes(ev, attributes)
            parts.append(delimited(b"\x5a", b"".join(ev)))
        events = ()
    for event in events:
        ev = [b"\x09" + _fixed64(ts)] if (ts := event.timestamp) else []
        if name := event.name:
            ev.append(_event_name(name))
        if attributes := event.attributes:
            _event_attributes(ev, attributes)
        if dropped := event.dropped_attributes:
            ev.append(b"\x20" + _varint(dropped))
        parts.append(delimited(b"\x5a", b"".join(ev)))
    if dropped := span.dropped_events:
        parts.append(b"\x60" + _varint(dropped))
    for link in span.links:
        lctx = link.context
        lk = [b"\x0a\x10" + lctx.trace_id.to_bytes(16, "big")]
        lk.append(b"\x12\x08" + lctx.span_id.to_bytes(8, "big"))
        if attributes := link.attributes:
            _link_attributes(lk, attributes)
        if dropped := link.dropped_attributes:
            lk.append(b"\x28" + _varint(dropped))
        lk.append(_LINK_FLAGS_REMOTE if lctx.is_remote else _LINK_FLAGS_LOCAL)
        parts.append(delimited(b"\x6a", b"".join(lk)))
    if dropped := span.dropped_links:
        parts.append(b"\x70" + _varint(dropped))
    status = span.status
    code = status.status_code.value
    if status.description:
        body = delimited(b"\x12", status.description.encode())
        parts.append(delimited(b"\x7a", body + b"\x18" + _BYTE[code] if code else body))
    else:
        parts.append(_STATUS[code])
    parts.append(_FLAGS_REMOTE if parent and parent.is_remote else _FLAGS_LOCAL)
    return delimited(b"\x12", b"".join(parts))


_STATUS = [b"\x7a\x00", b"\x7a\x02\x18\x01", b"\x7a\x02\x18\x02"]  # UNSET, OK, ERROR


def _cached(tag: bytes) -> Any:
    """A function from text to its field `tag`, remembering the texts it saw (span and event
    names repeat; a bounded number are kept)."""
    cache: dict[str, bytes] = {}

    def encode(text: str) -> bytes:
        out = cache.get(text)
        if out is None:
            if len(cache) >= _MAX_TEXTS:
                cache.clear()
            out = cache[text] = delimited(tag, text.encode())
        return out

    return encode


_MAX_TEXTS = 4096
_span_name = _cached(b"\x2a")  # Span.name
_event_name = _cached(b"\x12")  # Span.Event.name
_key = _cached(b"\x0a")  # KeyValue.key


def _attributes_field(tag: bytes) -> Callable[[list[bytes], Mapping[str, Any]], None]:
    """A function appending attributes as the repeated KeyValue field `tag` to a list of
    parts. The daemon's attribute values mostly repeat (model, operation, instance, finish
    reason, max tokens): the field of a (key, str, int or tuple value) pair is remembered (a bounded
    number of them), and a float's field up to its 8 bytes, so most attributes cost one dict
    lookup instead of a chain of encoding calls."""
    fields: dict[tuple[Any, ...], bytes] = {}  # exact str, int, tuple values: no True == 1
    float_heads: dict[str, bytes] = {}

    def put(parts: list[bytes], attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            t = type(value)
            if t is str or t is int or t is tuple:
                # a tuple's item types join its cache key: (1,) == (True,) == (1.0,)
                ck = (key, value) if t is not tuple else (key, value, *map(type, value))
                try:
                    field = fields.get(ck)
                except TypeError:  # an unhashable item: not the SDK's, encoded as it comes
                    field = _field(key, value)
                    if field is not None:
                        parts.append(field)
                    continue
                if field is None:
                    if len(fields) >= _MAX_FIELDS:
                        fields.clear()
                    field = _field(key, value)
                    if field is None:
                        continue
                    fields[ck] = field
            elif t is float:
                head = float_heads.get(key)
                if head is None:
                    if len(float_heads) >= _MAX_FIELDS:
                        float_heads.clear()
                    head = float_heads[key] = _field(key, 0.0)[:-8]  # type: ignore[index]
                field = head + _double(value)
            else:
                field = _field(key, value)
                if field is None:
                    continue
            parts.append(field)

    def _field(key: str, value: Any) -> bytes | None:
        try:
            return delimited(tag, _key_value(key, value))
        except Exception:  # as the library does: log, drop this attribute, keep the rest
            log.exception("OTLP: cannot encode attribute %s", key)
            return None

    return put


_MAX_FIELDS = 4096
_span_attributes = _attributes_field(b"\x4a")  # Span.attributes
_event_attributes = _attributes_field(b"\x1a")  # Span.Event.attributes
_link_attributes = _attributes_field(b"\x22")  # Span.Link.attributes
resource_attributes = _attributes_field(b"\x0a")  # Resource.attributes
scope_attributes = _attributes_field(b"\x1a")  # InstrumentationScope.attributes


def _key_value(key: str, value: Any) -> bytes:
    """KeyValue message (an empty key is proto3's default: left out)."""
    kv = delimited(b"\x12", _any_value(value))
    return _key(key) + kv if key else kv


def _any_value(value: Any) -> bytes:
    """AnyValue message of an attribute value."""
    t = type(value)  # exact types first: the common case, without isinstance's ABC checks
    if t is str:
        return delimited(b"\x0a", value.encode())
    if t is int:
        return b"\x18" + _int64(value)
    if t is float:
        return b"\x21" + _double(value)
    if t is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if t is tuple or t is list:
        return _array(value)
    if value is None:
        return b""
    # subclasses, in the library's order: bool before int, str and bytes before Sequence
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return delimited(b"\x0a", str(value).encode())
    if isinstance(value, int):
        return b"\x18" + _int64(int(value))
    if isinstance(value, float):
        return b"\x21" + _double(value)
    if isinstance(value, bytes):
        return delimited(b"\x3a", bytes(value))
    if isinstance(value, Sequence):
        return _array(value)
    if isinstance(value, Mapping):
        kvs = [delimited(b"\x0a", _key_value(str(k), v)) for k, v in value.items()]
        return delimited(b"\x32", b"".join(kvs))
    raise TypeError(f"invalid attribute value type {t.__name__}")


def _array(values: Sequence[Any]) -> bytes:
    """AnyValue.array_value, present even when empty, as the library has it."""
    return delimited(b"\x2a", b"".join([delimited(b"\x0a", _any_value(v)) for v in values]))


def _int64(n: int) -> bytes:
    """AnyValue.int_value's varint: two's complement, ten bytes, for a negative value."""
    if 0 <= n < 0x80:
        return _BYTE[n]
    if not _INT64_MIN <= n <= _INT64_MAX:
        raise ValueError(f"{n} is out of int64 range")
    return _varint(n if n >= 0 else n + (1 << 64))


_MAX_CACHED = 16  # resources / scopes whose encoding is kept; a daemon has one of each


_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class KvschedSpanExporter(OTLPSpanExporter):
    """The library's OTLP/gRPC span exporter with `SpanEncoder` as its encoder. The encoder
    writes the request's bytes itself, so the stub sends them as they are (no serializer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder = SpanEncoder()
        # the library builds its client from self._stub, again after an UNAVAILABLE error
        self._stub = _EncodedTraceServiceStub
        self._client = self._stub(self._channel)

    def _translate_data(self, data: Sequence[ReadableSpan]) -> bytes:  # type: ignore[override]
        return self._encoder.encode(data)


class _EncodedTraceServiceStub:
    """TraceServiceStub for requests given as their serialized bytes."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.Export = channel.unary_unary(
            _EXPORT_METHOD,
            request_serializer=None,  # bytes go out as they are
            response_deserializer=ExportTraceServiceResponse.FromString,
            _registered_method=True,
        )


class SpanEncoder:
    """Spans to one serialized ExportTraceServiceRequest, byte for byte as the library's
    `encode_spans(spans).SerializeToString()`: resource_spans in the order their Resource
    first appears in the batch, scope_spans likewise within each, spans in batch order;
    resources and scopes that compare equal share one entry. Calls may overlap (a flush beside
    the batch thread): a batch's state is local to its call, and a cache entry is only used for
    the very object it was made from."""

    def __init__(self) -> None:
        # id -> (the object, its encoding): the object is held so its id stays unique
        self._resources: dict[int, tuple[Any, bytes]] = {}
        self._scopes: dict[int, tuple[Any, bytes]] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        # resource -> (its encoding, [(scope, its encoding, [encoded spans])]), in batch order
        resources: list[tuple[Resource, bytes, list[tuple[Any, bytes, list[bytes]]]]] = []
        # (id(resource), id(scope)) -> where spans of that pair go; `resources` holds the objects
        groups: dict[tuple[int, int], list[bytes]] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope or None
            out = groups.get((id(resource), id(scope)))
            if out is None:
                out = groups[(id(resource), id(scope))] = self._group(resources, resource, scope)
            out.append(encode_span(span))
        parts = []
        for resource, encoded, scopes in resources:
            rs = [delimited(b"\x0a", encoded)]  # ResourceSpans.resource, present when empty
            for scope, scope_encoded, encoded_spans in scopes:
                ss = [delimited(b"\x0a", scope_encoded), *encoded_spans]
                if scope is not None and scope.schema_url:
                    ss.append(delimited(b"\x1a", scope.schema_url.encode()))
                rs.append(delimited(b"\x12", b"".join(ss)))
            if resource.schema_url:
                rs.append(delimited(b"\x1a", resource.schema_url.encode()))
            parts.append(delimited(b"\x0a", b"".join(rs)))
        return b"".join(parts)

    def _group(
        self,
        resources: list[tuple[Resource, bytes, list[tuple[Any, bytes, list[bytes]]]]],
        resource: Resource,
        scope: SDKScope | None,
    ) -> list[bytes]:
        """The encoded spans of (resource, scope) in this batch, a new entry unless an equal
        pair's is there already (the library groups by equality)."""
        entry = next((e for e in resources if e[0] == resource), None)
        if entry is None:
            entry = (resource, self._encoded(self._resources, resource), [])
            resources.append(entry)
        scopes = entry[2]
        for sc, _, encoded_spans in scopes:
            if sc == scope:
                return encoded_spans
        encoded_spans = []
        scopes.append((scope, self._encoded(self._scopes, scope), encoded_spans))
        return encoded_spans

    @staticmethod
    def _encoded(cache: dict[int, tuple[Any, bytes]], obj: Resource | SDKScope | None) -> bytes:
        """`obj`'s Resource / InstrumentationScope message, serialized, from `cache` when there."""
        hit = cache.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        parts = []
        if obj is not None and not isinstance(obj, Resource):
            if obj.name:
                parts.append(delimited(b"\x0a", obj.name.encode()))
            if obj.version:
                parts.append(delimited(b"\x12", obj.version.encode()))
        if obj is not None and obj.attributes:
            if isinstance(obj, Resource):
                resource_attributes(parts, obj.attributes)
            else:
                scope_attributes(parts, obj.attributes)
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        encoded = b"".join(parts)
        cache[id(obj)] = (obj, encoded)
        return encoded
