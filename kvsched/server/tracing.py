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
token or per step: a request costs one span, a handful of events and one batch-processor enqueue.

Which exporter (first match wins):
  1. OTEL_SDK_DISABLED=true: none, whatever else says.
  2. config `tracing_exporter` when it is not `none` (file, KVSCHED_TRACING_EXPORTER, flag).
  3. OTEL_TRACES_EXPORTER (comma list of otlp / console / none); unset: none.
The OTLP exporter speaks gRPC. Its endpoint and headers come from config `otlp_endpoint` /
`otlp_headers` ("k=v,k2=v2") when set, else from the standard OTEL_EXPORTER_OTLP_[TRACES_]*
variables, which the exporter reads itself. A config endpoint without a scheme is taken as
plaintext (`http://`); use `https://` for TLS. Sampling follows OTEL_TRACES_SAMPLER[_ARG]
(default parentbased_always_on: a client's unsampled traceparent yields no span), the service
name `service_name` when changed from its default, else OTEL_SERVICE_NAME, else `kvsched`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.re import parse_env_headers

import kvsched
from kvsched.core import FinishReason

log = logging.getLogger("kvsched.tracing")

EXPORTERS = ("otlp", "console")
DEFAULT_SERVICE_NAME = "kvsched"
OPERATION = "text_completion"


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
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    endpoint = config.otlp_endpoint.strip() or None
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint
    headers = parse_env_headers(config.otlp_headers, liberal=True) if config.otlp_headers else {}
    return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers) or None)


def make_tracing(config: Any, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The request tracer the config and environment ask for, or None (tracing off)."""
    environ = os.environ if environ is None else environ
    names = choose_exporters(config.tracing_exporter, environ)
    if not names:
        return None
    provider = TracerProvider(resource=make_resource(config))  # sampler from env
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(make_exporter(name, config, environ)))
    log.info("tracing requests to %s", ", ".join(names))
    return Tracing(provider, config.model)


def _span_of(req: Any) -> Span | None:
    """The live span of the request this core Request stands for (None for stale copies)."""
    tr = req.tag
    span = getattr(tr, "span", None)
    if span is None or tr.req is not req:
        return None
    return span  # type: ignore[no-any-return]


class Tracing:
    """Request spans on a TracerProvider of its own (several daemons may share a process)."""

    def __init__(self, provider: TracerProvider, model: str) -> None:
        self.provider = provider
        self.model = model
        self.span_name = f"{OPERATION} {model}"
        self.tracer = provider.get_tracer("kvsched", kvsched.__version__)
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._placed: set[str] = set()  # live traced requests placed at least once

    def wall_ns(self, t: float) -> int:
        """Wall-clock nanoseconds of monotonic time `t` (seconds)."""
        return int(t * 1e9) + self._offset_ns

    def request_accepted(self, tr: Any, carrier: Mapping[str, str]) -> None:
        req = tr.req
        start = self.wall_ns(req.arrival_time)
        span = self.tracer.start_span(
            self.span_name,
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            start_time=start,
            attributes={
                "gen_ai.operation.name": OPERATION,
                "gen_ai.request.model": self.model,
                "gen_ai.request.max_tokens": req.sampling.max_tokens,
                "gen_ai.response.id": req.req_id,
            },
        )
        if not span.is_recording():
            return  # sampled out: the hooks skip this request
        span.add_event("queued", timestamp=start)
        tr.span = span

    def lifecycle(self, engine: Any, events: Any) -> None:
        now = self.wall_ns(time.monotonic())
        where = {"kvsched.instance": engine.instance_id}
        placed = self._placed
        for req in events.scheduled:
            span = _span_of(req)
            if span is None:
                continue
            if req.req_id in placed:  # placed again: after a preemption or a lost instance
                span.add_event("resumed", where, now)
            else:
                placed.add(req.req_id)
                span.add_event("scheduled", where, now)
        for req in events.first_token:
            span = _span_of(req)
            if span is not None:
                span.add_event("first_token", timestamp=self.wall_ns(req.first_token_time))
        for req in events.preempted:
            span = _span_of(req)
            if span is not None:
                attrs = {**where, "kvsched.num_preemptions": req.num_preemptions}
                span.add_event("preempted", attrs, now)

    def request_moved(self, tr: Any, reason: str) -> None:
        """The instance holding the request was lost; it waits to be placed again."""
        span = tr.span
        if span is not None and span.is_recording():
            attrs = {"kvsched.instance": tr.engine.instance_id, "kvsched.reason": reason}
            span.add_event("instance_lost", attrs, self.wall_ns(time.monotonic()))

    def request_finished(self, tr: Any) -> None:
        span = tr.span
        if span is None or not span.is_recording():
            return
        req = tr.req
        self._placed.discard(req.req_id)
        end = self.wall_ns(req.finished_time if req.finished_time >= 0 else time.monotonic())
        reason = req.finish_reason.name.lower()
        span.set_attributes(finish_attributes(tr))
        span.add_event("finished", {"kvsched.finish_reason": reason}, end)
        if req.finish_reason == FinishReason.ERROR:
            span.set_status(Status(StatusCode.ERROR, req.finish_message or "request failed"))
        span.end(end_time=end)

    def end_open(self, trs: Iterable[Any]) -> None:
        """End the spans of requests still live at shutdown, so they are exported too."""
        end = self.wall_ns(time.monotonic())
        for tr in trs:
            span = tr.span
            if span is not None and span.is_recording():
                span.set_attributes(finish_attributes(tr))
                span.add_event("daemon_shutdown", timestamp=end)
                span.end(end_time=end)
        self._placed.clear()

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch processors


def finish_attributes(tr: Any) -> dict[str, Any]:
    """Usage and timings, as the client's Finished message reports them."""
    req = tr.req
    t0 = req.arrival_time
    attrs: dict[str, Any] = {
        "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        "gen_ai.usage.output_tokens": len(req.output_token_ids),
        "kvsched.cached_tokens": max(0, req.num_cached_tokens),
        "kvsched.num_preemptions": req.num_preemptions,
        "kvsched.instance": tr.engine.instance_id,
    }
    if req.finish_reason != FinishReason.NONE:
        attrs["gen_ai.response.finish_reasons"] = [req.finish_reason.name.lower()]
    if req.first_scheduled_time >= 0:
        attrs["kvsched.queue_time_s"] = max(0.0, req.first_scheduled_time - t0)
    if req.first_token_time >= 0:
        attrs["kvsched.ttft_s"] = max(0.0, req.first_token_time - t0)
    return attrs
