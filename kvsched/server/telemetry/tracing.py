"""OpenTelemetry request spans: one per request, arrival to finish (docs/ARCHITECTURE.md).

    client span (traceparent in gRPC metadata)
      └─ "text_completion <model>"  SERVER span, start = arrival, end = finish
           events: queued, scheduled{instance}, [host_cache_hit{instance, cached_tokens,
                   host_cached_tokens, storage_cached_tokens}], first_token,
                   (preempted{instance} | instance_lost{instance, reason}, resumed{instance})*,
                   finished{finish_reason}

"host_cache_hit": part of the prompt's prefix was swapped in from the instance's host-memory
KV tier, or fetched from the storage tier, at the first placement (kvsched.core.tiers,
kvsched.core.storage).

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

Which exporter runs, and how it is configured: `kvsched.server.telemetry.tracing`.

Which span exporter the daemon runs, and the tracer it builds (`make_tracing`).

Which exporter (first match wins):
  1. OTEL_SDK_DISABLED=true: none, whatever else says.
  2. config `tracing_exporter` when it is not `none` (file, KVSCHED_TRACING_EXPORTER, flag).
  3. OTEL_TRACES_EXPORTER (comma list of otlp / console / none); unset: none.
The OTLP exporter is the library's gRPC one with our span encoder (kvsched.server.telemetry.otlp). Its
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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.re import parse_env_headers

import kvsched
from kvsched.core import Role
from kvsched.server.telemetry.spans import (
    OPERATION,
    ROOT,
    PendingSpan,
    RequestTrace,
    _enqueue,
    read_only,
)

log = logging.getLogger("kvsched.tracing")

# The parent comes from W3C trace context (traceparent + tracestate) only: the request protocol
# is gRPC, whose clients propagate it; OTEL_PROPAGATORS is not read.
_W3C = TraceContextTextMapPropagator()


def _trace_of(req: Any) -> RequestTrace | None:
    """The RequestTrace of the live request this core Request stands for, made from `ROOT`
    when needed (None: not traced, or a stale copy)."""
    tr = req.tag
    trace = getattr(tr, "span", None)
    if trace is None or tr.req is not req:
        return None
    if trace is ROOT:
        trace = tr.span = RequestTrace()
    return trace


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

    def request_refused(
        self, request_id: str, reason: str, message: str, carrier: Mapping[str, str]
    ) -> None:
        """A refused request's span: ended at once, status ERROR with the refusal's message
        (refusals are rare: the SDK's own span API is fine here)."""
        tracer = self.provider.get_tracer("kvsched", kvsched.__version__)
        span = tracer.start_span(
            self.span_name,
            context=_W3C.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": OPERATION,
                "gen_ai.request.model": self.model,
                "kvsched.request_id": request_id,
                "kvsched.refused": reason,
            },
        )
        span.set_status(Status(StatusCode.ERROR, message))
        span.end()

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
            attrs = self._where[instance] = read_only({"kvsched.instance": instance})
        return attrs

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        """Start the request's trace: a child of the caller's W3C trace context when the
        metadata carries one (a new trace otherwise), if the sampler keeps it."""
        parent_ctx: Context | None = None
        parent: SpanContext | None = None
        if "traceparent" in carrier:
            parent_ctx = _W3C.extract(carrier)
            parent = get_current_span(parent_ctx).get_span_context()
            if parent is not None and not parent.is_valid:
                parent = None
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

    def lifecycle(self, info: Any, events: Any) -> None:
        """Only the rare events are recorded: the request's first placement and first token
        are its core Request's first_scheduled_time and first_token_time. Placements on a
        prefill or decode instance are recorded too (a hand-off moves the request)."""
        preempted, scheduled, awaiting = events.preempted, events.scheduled, self._awaiting
        explicit = scheduled and getattr(info, "role", Role.MIXED) != Role.MIXED
        if events.host_hits:
            self._host_hits(info, events.host_hits)
        if not (preempted or explicit or (scheduled and awaiting)):
            return  # the common step: nothing rare
        now = self.wall_ns(time.monotonic())
        instance = info.instance_id
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

    def _host_hits(self, info: Any, reqs: list[Any]) -> None:
        """Requests whose first placement swapped part of their prefix in from host memory."""
        now = self.wall_ns(time.monotonic())
        where = self.where(info.instance_id)
        for req in reqs:
            trace = _trace_of(req)
            if trace is not None:
                attrs = {
                    **where,
                    "kvsched.cached_tokens": req.num_cached_tokens,
                    "kvsched.host_cached_tokens": req.num_host_cached_tokens,
                    "kvsched.storage_cached_tokens": req.num_storage_cached_tokens,
                }
                trace.add_event("host_cache_hit", attrs, now)

    def request_moved(self, tr: Any, reason: str) -> None:
        """The instance holding the request was lost; it waits to be placed again."""
        trace = tr.span
        if trace is None:
            return
        if trace is ROOT:
            trace = tr.span = RequestTrace()
        instance = tr.instance_id
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
                req.num_preemptions, tr.instance_id, req.finish_reason,
                req.finish_message, req.arrival_time, req.first_scheduled_time,
                req.first_token_time, req.num_draft_tokens, req.num_accepted_drafts,
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


log = logging.getLogger("kvsched.tracing")

EXPORTERS = ("otlp", "console")
DEFAULT_SERVICE_NAME = "kvsched"


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
    # Imported only when chosen: the OTLP exporter library takes a while to import.
    from kvsched.server.telemetry.otlp import KvschedSpanExporter

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
