"""A request's span as the tracer keeps it and hands it to the exporters.

While the request lives, `Tracked.span` is `ROOT` (the common case) or a `RequestTrace` (a
parent, or rare events to remember). At its end one tuple of the request's values goes to the
processors inside a `PendingSpan`, a ReadableSpan built where it is first read (the batch
processor's thread, as its exporter encodes it). `RequestEvents` lets the OTLP encoder
(kvsched.server.telemetry.otlp) read the events as a flat list. The hooks that fill these, and the span's
shape, are in `kvsched.server.telemetry.tracing`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from types import MappingProxyType
from typing import Any, overload

from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from kvsched.core import FinishReason

OPERATION = "text_completion"
MAX_EVENTS = SpanLimits().max_events or 128  # OTEL_SPAN_EVENT_COUNT_LIMIT; "finished" may exceed
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_REASON_NAMES = {r: r.name.lower() for r in FinishReason}  # Enum.name is a property call
_REASON_TUPLES = {r: (name,) for r, name in _REASON_NAMES.items()}  # immutable: shareable
read_only = MappingProxyType  # event attributes shared by many spans' events
_FINISHED = {r: read_only({"kvsched.finish_reason": name}) for r, name in _REASON_NAMES.items()}


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


class RequestEvents(Sequence[Event]):
    """A finished request span's events: the trace's flat list (name, attributes, timestamp,
    name, ...), made SDK Event objects only when first read. The OTLP encoder
    (kvsched.server.telemetry.otlp) reads the list and never asks, which spares the event loop ~1 us and
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
        num_drafts, num_accepted,
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
    if num_drafts:  # speculative decoding: the request's drafts verified / accepted
        attrs["kvsched.spec_decode.draft_tokens"] = num_drafts
        attrs["kvsched.spec_decode.accepted_tokens"] = num_accepted
        attrs["kvsched.spec_decode.acceptance_rate"] = num_accepted / num_drafts
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
