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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope as SDKScope

from kvsched.server.otlp_wire import delimited, encode_span, resource_attributes, scope_attributes

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
