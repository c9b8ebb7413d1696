"""OpenTelemetry: one span per request, from arrival to finish (DESIGN section 6).

    client span (traceparent in gRPC metadata)
      └─ "text_completion <model>"  SERVER span, start = arrival, end = finish
           events: queued, scheduled{instance}, first_token,
                   (preempted{instance} | instance_lost{instance, reason}, resumed{instance})*,
                   finished{finish_reason}

"resumed" is any placement after the first. A preemption the worker overtakes by finishing
the request first shows as a last "preempted" with no "resumed" (the finish is kept).

Timestamps are the request's own monotonic times moved onto the wall clock by one offset
taken at start-up: queued = arrival, scheduled = first_scheduled_time (when the core placed it;
the instance is where it was placed first), first_token, finish. The rare events (preempted,
resumed, instance_lost, and placements on prefill / decode instances) are stamped when they
happen (resumed / preempted when the engine dispatches the step's events, microseconds after
schedule() decided them); the events are ordered by time. No span per token or per step, and
next to no work per request on the event loop: a shared marker at arrival, nothing per step
unless something rare happens, one tuple at finish; the span itself is built off the loop,
where the batch processor's thread first reads it (see `Tracing`, `PendingSpan`).

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
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import itemgetter
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
from opentelemetry.trace.span import TraceState
from opentelemetry.util.re import parse_env_headers
from opentelemetry.util.types import Attributes

import kvsched
from kvsched.core import FinishReason, Role

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


class _RootTrace:
    """`Tracked.span` of a sampled request without a parent that nothing rare happened to yet
    (the common case): one shared object, `ROOT`; its ids are made when the span is built."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ROOT"


ROOT = _RootTrace()


class RequestTrace:
    """`Tracked.span` of a traced request that is not the common case: it has a parent (the
    client's span context and trace state), a sampler's trace id or trace state, or rare events
    to remember (preempted, instance_lost, resumed, and placements on prefill / decode
    instances), in one flat list, name, attributes, timestamp after another, made on the
    first of them. The common events (queued, scheduled, first token) are read from the core
    Request's times when the span is built.

    Why flat, and why so few objects: every object that lives until the span is exported
    (~0.4 s at 1,300 spans/s) counts toward the daemon's next garbage collection, and in the
    daemon's large heap those collections cost ~1-2 us per such object (gen-0, gen-1 and
    gen-2 together, measured in bench.transport's turnover case)."""

    __slots__ = ("events", "first_instance", "parent", "placed", "trace_id", "trace_state")

    def __init__(
        self,
        parent: SpanContext | None = None,
        trace_id: int | None = None,
        trace_state: TraceState | None = None,
    ) -> None:
        self.parent = parent
        self.trace_id = trace_id  # None: a new trace's, made when the span is built
        self.trace_state = trace_state
        self.events: list[Any] | None = None
        self.first_instance: str | None = None  # where it was placed first, once known
        self.placed = False  # placements are recorded as events (not a mixed instance)

    def add_event(self, name: str, attributes: Attributes, timestamp_ns: int) -> None:
        events = self.events
        if events is None:
            self.events = [name, attributes, timestamp_ns]
        elif len(events) < 3 * MAX_EVENTS:
            events.append(name)
            events.append(attributes)
            events.append(timestamp_ns)


def _trace_of(req: Any) -> RequestTrace | None:
    """The RequestTrace of the live request this core Request stands for, made from `ROOT`
    when needed (None: not traced, or a stale copy)."""
    tr = req.tag
    trace = getattr(tr, "span", None)
    if trace is None or tr.req is not req:
        return None
    if trace is ROOT:
        trace = tr.span = RequestTrace()
    return trace  # type: ignore[no-any-return]


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


# The fields ReadableSpan's properties and methods read; a PendingSpan makes them on first read.
_SPAN_FIELDS = frozenset(
    (
        "_name", "_context", "_kind", "_instrumentation_info", "_instrumentation_scope",
        "_parent", "_start_time", "_end_time", "_attributes", "_events", "_links",
        "_resource", "_status",
    )
)  # fmt: skip
_BUILD_LOCK = threading.Lock()  # two exporters' threads may read one span first at once


class PendingSpan(RequestSpan):
    """A finished request's span as the event loop hands it over: what it was made of (one
    tuple of the request's values), built into a complete ReadableSpan (ids, attributes,
    events, status) the first time anything reads it: on a batch processor's thread, right
    before its exporter encodes it. The event loop pays for two objects per request; the
    built span lives only while its batch is exported."""

    def __init__(self, pending: tuple[Any, ...]) -> None:  # no ReadableSpan.__init__: lazy
        self._pending = pending

    def __getattr__(self, name: str) -> Any:
        if name not in _SPAN_FIELDS:
            raise AttributeError(name)
        fields = self.__dict__
        with _BUILD_LOCK:
            if "_context" not in fields:  # dict.update below is atomic under the GIL
                fields.update(_build(self._pending))
        return fields[name]


def _build(pending: tuple[Any, ...]) -> dict[str, Any]:
    """The ReadableSpan fields of a finished request (see Tracing._emit for `pending`)."""
    (
        tracing, trace, end_name, end_t, req_id, max_tokens, num_prompt, num_output, cached,
        num_preemptions, instance, reason, message, arrival, scheduled, first_token,
    ) = pending  # fmt: skip
    ids = tracing.provider.id_generator
    wall = tracing.wall_ns
    parent = trace_id = trace_state = rare = first_instance = None
    placed = False
    if trace is not ROOT:
        parent, trace_id, trace_state = trace.parent, trace.trace_id, trace.trace_state
        rare, first_instance, placed = trace.events, trace.first_instance, trace.placed
    if trace_id is None:
        trace_id = ids.generate_trace_id()
    context = SpanContext(
        trace_id, ids.generate_span_id(), is_remote=False, trace_flags=_SAMPLED,
        trace_state=trace_state,
    )  # fmt: skip
    start = wall(arrival)
    events: list[Any] = ["queued", None, start]
    if scheduled >= 0 and not placed:
        events += ("scheduled", tracing.where(first_instance or instance), wall(scheduled))
    if first_token >= 0:
        events += ("first_token", None, wall(first_token))
    if rare:
        events = _merged(events, rare)
        del events[3 * MAX_EVENTS :]
    end = wall(end_t)
    status = _UNSET
    if end_name == "finished":
        events += ("finished", _FINISHED[reason], end)
        if reason == FinishReason.ERROR:
            status = Status(StatusCode.ERROR, message or "request failed")
    else:
        events += (end_name, None, end)
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.request.model": tracing.model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.response.id": req_id,
        "gen_ai.usage.input_tokens": num_prompt,
        "gen_ai.usage.output_tokens": num_output,
        "kvsched.cached_tokens": max(0, cached),
        "kvsched.num_preemptions": num_preemptions,
        "kvsched.instance": instance,
    }
    if reason != FinishReason.NONE:
        attrs["gen_ai.response.finish_reasons"] = _REASON_TUPLES[reason]
    if scheduled >= 0:
        attrs["kvsched.queue_time_s"] = max(0.0, scheduled - arrival)
    if first_token >= 0:
        attrs["kvsched.ttft_s"] = max(0.0, first_token - arrival)
    return {
        "_name": tracing.span_name,
        "_context": context,
        "_kind": SpanKind.SERVER,
        "_instrumentation_info": None,
        "_instrumentation_scope": tracing.scope,
        "_parent": parent,
        "_start_time": start,
        "_end_time": end,
        "_attributes": attrs,
        "_events": RequestEvents(events),
        "_links": (),
        "_resource": tracing.provider.resource,
        "_status": status,
    }


def _merged(events: list[Any], rare: list[Any]) -> list[Any]:
    """Two flat event lists as one, by timestamp; at equal times `events` (the request's own
    queued / scheduled / first token) first (a stable sort)."""
    it, rit = iter(events), iter(rare)
    triples = [*zip(it, it, it, strict=True), *zip(rit, rit, rit, strict=True)]
    triples.sort(key=itemgetter(2))
    return [x for triple in triples for x in triple]


def _enqueue(processor: SpanProcessor) -> Callable[[ReadableSpan], None]:
    """How a finished span reaches `processor`. The SDK's BatchSpanProcessor.on_end reads the
    span's context (is it sampled? ours always are) and then emits it to its batch queue
    (queue limit, drops, OTEL_BSP_* settings, flush at shutdown: all in emit). Calling its
    emit directly leaves the context unbuilt on the event loop; any other processor gets
    on_end, and the span is built when it reads it."""
    if type(processor) is BatchSpanProcessor:
        emit = getattr(getattr(processor, "_batch_processor", None), "emit", None)
        if callable(emit):
            return emit  # type: ignore[no-any-return]
    return processor.on_end


class Tracing:
    """Request spans for one daemon, on a TracerProvider of its own.

    The provider supplies the sampler (OTEL_TRACES_SAMPLER), the resource, the id generator and
    the span processors. The spans themselves skip the SDK's Span API, whose per-call attribute
    validation and locking cost ~130 us per request on the development box (bench.span_cost;
    our attributes are known-good scalars). On the event loop a request costs almost nothing:
    at arrival the sampling decision and, in the common case (no parent, sampled), the shared
    `ROOT` marker on `Tracked.span`; per step only the rare events (preempted, resumed,
    instance_lost) are recorded; at finish one tuple of the request's values goes to the
    processors inside a PendingSpan, a ReadableSpan built where it is first read (the batch
    processor's thread, as its exporter encodes it).
    """

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.provider = provider
        self.processors: list[SpanProcessor] = []
        self._sinks: list[Callable[[ReadableSpan], None]] = []
        self.model = model
        self.span_name = f"{OPERATION} {model}"
        self.scope = InstrumentationScope("kvsched", kvsched.__version__)
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        # The SDK's default sampler (parentbased_always_on) and always_on sample every trace
        # without a parent, with no trace state: such a request skips the sampler's call
        # chain (~20 Python calls, several us on the daemon's busy, cache-cold event loop).
        # Any other sampler, or a request with a parent, is asked as usual.
        self._roots_sampled = provider.sampler is DEFAULT_ON or provider.sampler is ALWAYS_ON
        # live traced requests preempted or moved off a lost instance after being placed:
        # their next placement is a "resumed" event
        self._awaiting: set[str] = set()
        self._where: dict[str, Mapping[str, Any]] = {}  # instance -> its events' attributes

    def add_processor(self, processor: SpanProcessor) -> None:
        self.provider.add_span_processor(processor)  # so provider.shutdown() flushes it
        self.processors.append(processor)
        self._sinks.append(_enqueue(processor))

    def wall_ns(self, t: float) -> int:
        """Wall-clock nanoseconds of monotonic time `t` (seconds)."""
        return int(t * 1e9) + self._offset_ns

    def where(self, instance: str) -> Mapping[str, Any]:
        """The shared, read-only attributes of an event on `instance`."""
        attrs = self._where.get(instance)
        if attrs is None:  # two threads may both make it: equal, either is kept
            attrs = self._where[instance] = _read_only({"kvsched.instance": instance})
        return attrs

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """Start the request's trace: a child of the caller's W3C trace context when the
        metadata carries one (a new trace otherwise), if the sampler keeps it."""
        if "traceparent" in carrier:
            parent_ctx = _W3C.extract(carrier)
            parent: SpanContext | None = get_current_span(parent_ctx).get_span_context()
            if parent is not None and not parent.is_valid:
                parent = None
        else:
            parent_ctx = parent = None
        if parent is None and self._roots_sampled:
            tr.span = ROOT  # what the sampler would say: sampled, no parent's state
            return
        provider = self.provider
        trace_id = (
            parent.trace_id if parent is not None else provider.id_generator.generate_trace_id()
        )
        sampled = provider.sampler.should_sample(
            parent_ctx, trace_id, self.span_name, SpanKind.SERVER
        )
        if not sampled.decision.is_sampled():  # type: ignore[no-untyped-call]
            return  # not exported: the hooks skip this request
        tr.span = RequestTrace(parent, trace_id, sampled.trace_state)

    def lifecycle(self, engine: Any, events: Any) -> None:
        """Only the rare events are recorded: the request's first placement and first token
        are its core Request's first_scheduled_time and first_token_time. Placements on a
        prefill or decode instance are recorded too (a hand-off moves the request)."""
        preempted, scheduled, awaiting = events.preempted, events.scheduled, self._awaiting
        explicit = scheduled and getattr(engine, "role", Role.MIXED) != Role.MIXED
        if not (preempted or explicit or (scheduled and awaiting)):
            return  # the common step: nothing rare
        now = self.wall_ns(time.monotonic())
        instance = engine.instance_id
        where = self.where(instance)
        if scheduled and (awaiting or explicit):
            for req in scheduled:
                if req.req_id in awaiting:
                    awaiting.discard(req.req_id)
                    trace = _trace_of(req)
                    if trace is not None:
                        trace.add_event("resumed", where, now)
                elif explicit and (trace := _trace_of(req)) is not None:
                    trace.add_event("resumed" if trace.placed else "scheduled", where, now)
                    trace.placed = True
        for req in preempted:
            trace = _trace_of(req)
            if trace is not None:
                if trace.first_instance is None:
                    trace.first_instance = instance
                attrs = {**where, "kvsched.num_preemptions": req.num_preemptions}
                trace.add_event("preempted", attrs, now)
                awaiting.add(req.req_id)

    def request_moved(self, tr: Any, reason: str) -> None:
        """The instance holding the request was lost; it waits to be placed again."""
        trace = tr.span
        if trace is None:
            return
        if trace is ROOT:
            trace = tr.span = RequestTrace()
        instance = tr.engine.instance_id
        if tr.req.first_scheduled_time >= 0:  # placed before: the next placement resumes it
            if trace.first_instance is None:
                trace.first_instance = instance
            self._awaiting.add(tr.req.req_id)
        attrs = {"kvsched.instance": instance, "kvsched.reason": reason}
        trace.add_event("instance_lost", attrs, self.wall_ns(time.monotonic()))

    def request_finished(self, tr: Any) -> None:
        trace = tr.span
        if trace is None:
            return
        tr.span = None  # ended
        req = tr.req
        if trace is not ROOT:
            self._awaiting.discard(req.req_id)
        end = req.finished_time if req.finished_time >= 0 else time.monotonic()
        self._emit(trace, tr, "finished", end)

    def _emit(self, trace: Any, tr: Any, end_name: str, end: float) -> None:
        """Hand the finished request to the processors: what its span is built from, read
        now (the request's values can still change), in one tuple (see `_build`)."""
        req = tr.req
        span = PendingSpan(
            (
                self, trace, end_name, end, req.req_id, req.sampling.max_tokens,
                len(req.prompt_token_ids), len(req.output_token_ids), req.num_cached_tokens,
                req.num_preemptions, tr.engine.instance_id, req.finish_reason,
                req.finish_message, req.arrival_time, req.first_scheduled_time,
                req.first_token_time,
            )
        )  # fmt: skip
        for sink in self._sinks:
            sink(span)

    def end_open(self, trs: Iterable[Any]) -> None:
        """End the spans of requests still live at shutdown, so they are exported too."""
        end = time.monotonic()
        for tr in trs:
            trace = tr.span
            if trace is not None:
                tr.span = None
                self._emit(trace, tr, "daemon_shutdown", end)
        self._awaiting.clear()

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processors
