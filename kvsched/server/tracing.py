"""OpenTelemetry: one span per request, from arrival to finish (DESIGN section 6).

    client span (traceparent in gRPC metadata)
      └─ "text_completion <model>"  SERVER span, start = arrival, end = finish
           events: queued, scheduled{instance}, first_token,
                   (preempted{instance} | instance_lost{instance, reason}, resumed{instance})*,
                   finished{finish_reason}

"resumed" is any placement after the first. A preemption the worker overtakes by finishing
the request first shows as a last "preempted" with no "resumed" (the finish is kept).

Timestamps are the request's own monotonic times (arrival, first token, finish) moved onto the
wall clock by one offset taken at start-up; scheduled / resumed / preempted are stamped when the
engine dispatches the step's events, microseconds after schedule() decided them. No span per
token or per step: a request costs one span, its events in one flat list and one batch-processor
enqueue (see `Tracing` for why the span is assembled at finish, `RequestTrace` for why so few
objects).

Which exporter (first match wins):
  1. OTEL_SDK_DISABLED=true: none, whatever else says.
  2. config `tracing_exporter` when it is not `none` (file, KVSCHED_TRACING_EXPORTER, flag).
  3. OTEL_TRACES_EXPORTER (comma list of otlp / console / none); unset: none.
The OTLP exporter is the library's gRPC one with our span encoder (kvsched.server.otlp). Its
endpoint and headers come from config `otlp_endpoint` / `otlp_headers` ("k=v,k2=v2") when
set, else from the standard OTEL_EXPORTER_OTLP_[TRACES_]* variables, which the exporter reads
itself. A config endpoint without a scheme is taken as plaintext (`http://`); use `https://`
for TLS. Sampling follows OTEL_TRACES_SAMPLER[_ARG] (default parentbased_always_on: a client's
unsampled traceparent yields no span), the service name `service_name` when changed from its
default, else OTEL_SERVICE_NAME, else `kvsched`. The parent comes from W3C `traceparent` /
`tracestate` only (OTEL_PROPAGATORS is not read: the request protocol is gRPC, whose clients
propagate W3C trace context).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, overload

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.re import parse_env_headers
from opentelemetry.util.types import Attributes

import kvsched
from kvsched.core import FinishReason

log = logging.getLogger("kvsched.tracing")

EXPORTERS = ("otlp", "console")
DEFAULT_SERVICE_NAME = "kvsched"
OPERATION = "text_completion"
MAX_EVENTS = SpanLimits().max_events or 128  # OTEL_SPAN_EVENT_COUNT_LIMIT; "finished" may exceed
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_REASON_NAMES = {r: r.name.lower() for r in FinishReason}  # Enum.name is a property call
_REASON_TUPLES = {r: (name,) for r, name in _REASON_NAMES.items()}  # immutable: shareable
_read_only = MappingProxyType  # event attributes shared by many spans' events
_FINISHED = {r: _read_only({"kvsched.finish_reason": name}) for r, name in _REASON_NAMES.items()}
_W3C = TraceContextTextMapPropagator()  # traceparent + tracestate only (DESIGN section 6)


def choose_exporters(config_value: str, environ: Mapping[str, str]) -> list[str]:
    """The exporters to run (empty: tracing off), by the rules in the module docstring."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        if config_value != "none":
            log.warning("OTEL_SDK_DISABLED=true: tracing off despite tracing_exporter")
        return []
    if config_value != "none":
        return [config_value]
    chosen: list[str] = []
    for name in environ.get("OTEL_TRACES_EXPORTER", "").split(","):
        name = name.strip().lower()
        if name == "none":
            return []
        if name in EXPORTERS and name not in chosen:
            chosen.append(name)
        elif name and name not in EXPORTERS:
            log.warning(
                "OTEL_TRACES_EXPORTER: kvsched supports otlp, console, none; ignoring %r", name
            )
    return chosen


def make_resource(config: Any) -> Resource:
    attrs: dict[str, Any] = {
        "service.version": kvsched.__version__,
        "service.instance.id": uuid.uuid4().hex,
    }
    if config.instances:
        attrs["kvsched.instances"] = sorted(config.instances)
    resource = Resource.create(attrs)  # reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    if config.service_name != DEFAULT_SERVICE_NAME:
        return resource.merge(Resource({SERVICE_NAME: config.service_name}))
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def make_exporter(name: str, config: Any, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol.strip().lower() != "grpc":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: kvsched exports OTLP over gRPC", protocol)
    from kvsched.server.otlp import KvschedSpanExporter

    endpoint = config.otlp_endpoint.strip() or None
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint
    headers = parse_env_headers(config.otlp_headers, liberal=True) if config.otlp_headers else {}
    return KvschedSpanExporter(endpoint=endpoint, headers=dict(headers) or None)


def make_tracing(config: Any, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The request tracer the config and environment ask for, or None (tracing off)."""
    environ = os.environ if environ is None else environ
    names = choose_exporters(config.tracing_exporter, environ)
    if not names:
        return None
    tracing = Tracing(TracerProvider(resource=make_resource(config)), config.model)
    for name in names:
        tracing.add_processor(BatchSpanProcessor(make_exporter(name, config, environ)))
    log.info("tracing requests to %s", ", ".join(names))
    return tracing


def _trace_of(req: Any) -> RequestTrace | None:
    """The live trace of the request this core Request stands for (None for stale copies)."""
    tr = req.tag
    trace = getattr(tr, "span", None)
    if trace is None or tr.req is not req:
        return None
    return trace  # type: ignore[no-any-return]


class RequestTrace:
    """One traced request while it lives (on `Tracked.span`): its span context, fixed at
    arrival, and its events in one flat list, name, attributes, timestamp after another. The
    SDK span is built once, at finish.

    Why flat, and why the events' attribute dicts are shared where they can be: every object
    that lives until the span is exported (~0.4 s at 1,300 spans/s) counts toward the daemon's
    next garbage collection, and in the daemon's large heap those collections cost ~1-2 us per
    such object (gen-0, gen-1 and gen-2 together, measured in bench.transport's turnover
    case); a tuple per event was four or five of them per request."""

    __slots__ = ("context", "ended", "events", "parent", "start_ns")

    def __init__(self, context: SpanContext, parent: SpanContext | None, start_ns: int) -> None:
        self.context = context
        self.parent = parent
        self.start_ns = start_ns
        self.events: list[Any] = ["queued", None, start_ns]
        self.ended = False

    def get_span_context(self) -> SpanContext:
        """As on an OpenTelemetry span: for logs that want the trace and span ids."""
        return self.context

    def is_recording(self) -> bool:
        return not self.ended

    def add_event(self, name: str, attributes: Attributes, timestamp_ns: int) -> None:
        events = self.events
        if len(events) < 3 * MAX_EVENTS:
            events.append(name)
            events.append(attributes)
            events.append(timestamp_ns)

    def end_event(self, name: str, attributes: Attributes, timestamp_ns: int) -> None:
        """The last event (finished, daemon_shutdown): kept even past MAX_EVENTS."""
        self.events += (name, attributes, timestamp_ns)


class RequestEvents(Sequence[Event]):
    """A finished request span's events: the trace's flat list (name, attributes, timestamp,
    name, ...), made SDK Event objects only when first read. The OTLP encoder
    (kvsched.server.otlp) reads the list and never asks, which spares the event loop ~1 us and
    four to six objects per request (see RequestTrace on why objects count); other exporters
    (console, a user's processor) see an ordinary sequence of Events."""

    __slots__ = ("_events", "records")

    def __init__(self, records: list[Any]) -> None:
        self.records = records  # not changed after the span ends
        self._events: tuple[Event, ...] | None = None

    def triples(self) -> Iterator[tuple[str, Attributes, int]]:
        """(name, attributes, timestamp) of each event, in order."""
        it = iter(self.records)
        return zip(it, it, it, strict=True)

    def _built(self) -> tuple[Event, ...]:
        events = self._events
        if events is None:  # two threads may both build: same content, either is kept
            events = self._events = tuple(Event(n, a, ts) for n, a, ts in self.triples())
        return events

    @overload
    def __getitem__(self, i: int) -> Event: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Event]: ...
    def __getitem__(self, i: int | slice) -> Event | Sequence[Event]:
        return self._built()[i]

    def __len__(self) -> int:
        return len(self.records) // 3

    def __iter__(self) -> Iterator[Event]:
        return iter(self._built())


class RequestSpan(ReadableSpan):
    """A finished request's span: a ReadableSpan whose `events` are its RequestEvents as they
    are (ReadableSpan's copies them into a tuple on every read, which would make the Events)."""

    @property
    def events(self) -> Sequence[Event]:
        return self._events  # RequestEvents: read-only


class Tracing:
    """Request spans for one daemon, on a TracerProvider of its own.

    The provider supplies the sampler (OTEL_TRACES_SAMPLER), the resource, the id generator and
    the span processors. The spans themselves skip the SDK's Span API, whose per-call attribute
    validation and locking cost ~130 us per request on the development box against ~12 us for
    the hooks here (bench.span_cost; our attributes are known-good scalars); a finished span
    goes straight to the batch processors as a ReadableSpan (RequestSpan), the object the SDK
    itself hands them.
    """

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.provider = provider
        self.processors: list[SpanProcessor] = []
        self.model = model
        self.span_name = f"{OPERATION} {model}"
        self.scope = InstrumentationScope("kvsched", kvsched.__version__)
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        # The SDK's default sampler (parentbased_always_on) and always_on sample every trace
        # without a parent, with no trace state: such a request skips the sampler's call
        # chain (~20 Python calls, several us on the daemon's busy, cache-cold event loop).
        # Any other sampler, or a request with a parent, is asked as usual.
        self._roots_sampled = provider.sampler is DEFAULT_ON or provider.sampler is ALWAYS_ON
        self._placed: set[str] = set()  # live traced requests placed at least once
        self._where: dict[str, Mapping[str, Any]] = {}  # instance -> its events' attributes

    def add_processor(self, processor: SpanProcessor) -> None:
        self.provider.add_span_processor(processor)  # so provider.shutdown() flushes it
        self.processors.append(processor)

    def wall_ns(self, t: float) -> int:
        """Wall-clock nanoseconds of monotonic time `t` (seconds)."""
        return int(t * 1e9) + self._offset_ns

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """Start the request's trace: a child of the caller's W3C trace context when the
        metadata carries one (a new trace otherwise), if the sampler keeps it."""
        req = tr.req
        parent_ctx = _W3C.extract(carrier) if "traceparent" in carrier else None
        parent: SpanContext | None = get_current_span(parent_ctx).get_span_context()
        provider = self.provider
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
        else:
            parent, trace_id = None, provider.id_generator.generate_trace_id()
        if parent is None and self._roots_sampled:
            trace_state = None  # what the sampler would say: sampled, no parent's state
        else:
            sampled = provider.sampler.should_sample(
                parent_ctx, trace_id, self.span_name, SpanKind.SERVER
            )
            if not sampled.decision.is_sampled():  # type: ignore[no-untyped-call]
                return  # not exported: the hooks skip this request
            trace_state = sampled.trace_state
        context = SpanContext(
            trace_id,
            provider.id_generator.generate_span_id(),
            is_remote=False,
            trace_flags=_SAMPLED,
            trace_state=trace_state,
        )
        tr.span = RequestTrace(context, parent, self.wall_ns(req.arrival_time))

    def lifecycle(self, engine: Any, events: Any) -> None:
        if not (events.scheduled or events.first_token or events.preempted):
            return  # a step that placed, preempted and started nobody
        now = self.wall_ns(time.monotonic())
        where = self._where.get(engine.instance_id)
        if where is None:
            where = self._where[engine.instance_id] = _read_only(
                {"kvsched.instance": engine.instance_id}
            )
        placed = self._placed
        for req in events.scheduled:
            trace = _trace_of(req)
            if trace is None:
                continue
            if req.req_id in placed:  # placed again: after a preemption or a lost instance
                trace.add_event("resumed", where, now)
            else:
                placed.add(req.req_id)
                trace.add_event("scheduled", where, now)
        for req in events.first_token:
            trace = _trace_of(req)
            if trace is not None:
                trace.add_event("first_token", None, self.wall_ns(req.first_token_time))
        for req in events.preempted:
            trace = _trace_of(req)
            if trace is not None:
                attrs = {**where, "kvsched.num_preemptions": req.num_preemptions}
                trace.add_event("preempted", attrs, now)

    def request_moved(self, tr: Any, reason: str) -> None:
        """The instance holding the request was lost; it waits to be placed again."""
        trace = tr.span
        if trace is not None and not trace.ended:
            attrs = {"kvsched.instance": tr.engine.instance_id, "kvsched.reason": reason}
            trace.add_event("instance_lost", attrs, self.wall_ns(time.monotonic()))

    def request_finished(self, tr: Any) -> None:
        trace = tr.span
        if trace is None or trace.ended:
            return
        req = tr.req
        self._placed.discard(req.req_id)
        end = self.wall_ns(req.finished_time if req.finished_time >= 0 else time.monotonic())
        status = _UNSET
        if req.finish_reason == FinishReason.ERROR:
            status = Status(StatusCode.ERROR, req.finish_message or "request failed")
        trace.end_event("finished", _FINISHED[req.finish_reason], end)
        self._export(trace, finish_attributes(self.model, tr), status, end)

    def _export(self, trace: RequestTrace, attrs: dict[str, Any], status: Status, end: int) -> None:
        trace.ended = True
        span = RequestSpan(
            self.span_name,
            context=trace.context,
            parent=trace.parent,
            resource=self.provider.resource,
            attributes=attrs,
            events=RequestEvents(trace.events),
            kind=SpanKind.SERVER,
            status=status,
            start_time=trace.start_ns,
            end_time=end,
            instrumentation_scope=self.scope,
        )
        for processor in self.processors:
            processor.on_end(span)

    def end_open(self, trs: Iterable[Any]) -> None:
        """End the spans of requests still live at shutdown, so they are exported too."""
        end = self.wall_ns(time.monotonic())
        for tr in trs:
            trace = tr.span
            if trace is not None and not trace.ended:
                trace.end_event("daemon_shutdown", None, end)
                self._export(trace, finish_attributes(self.model, tr), _UNSET, end)
        self._placed.clear()

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processors


def finish_attributes(model: str, tr: Any) -> dict[str, Any]:
    """The span's attributes: the request, and usage and timings as the client's Finished
    message reports them."""
    req = tr.req
    t0 = req.arrival_time
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": req.sampling.max_tokens,
        "gen_ai.response.id": req.req_id,
        "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        "gen_ai.usage.output_tokens": len(req.output_token_ids),
        "kvsched.cached_tokens": max(0, req.num_cached_tokens),
        "kvsched.num_preemptions": req.num_preemptions,
        "kvsched.instance": tr.engine.instance_id,
    }
    if req.finish_reason != FinishReason.NONE:
        attrs["gen_ai.response.finish_reasons"] = _REASON_TUPLES[req.finish_reason]
    if req.first_scheduled_time >= 0:
        attrs["kvsched.queue_time_s"] = max(0.0, req.first_scheduled_time - t0)
    if req.first_token_time >= 0:
        attrs["kvsched.ttft_s"] = max(0.0, req.first_token_time - t0)
    return attrs
