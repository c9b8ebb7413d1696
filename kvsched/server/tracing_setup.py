"""Which span exporter the daemon runs, and the tracer it builds (`make_tracing`).

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
import uuid
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.util.re import parse_env_headers

import kvsched
from kvsched.server.tracing import Tracing

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
