"""Telemetry against real parts: spans exported over OTLP/gRPC to a receiver in this process,
/metrics scraped over HTTP, a daemon with a sim worker on loopback (telemetry_harness)."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    ParentBased,
    ParentBasedTraceIdRatio,
    TraceIdRatioBased,
)
from opentelemetry.trace.span import TraceState
from prometheus_client.parser import text_string_to_metric_families

import kvsched
from kvsched.core import (
    Events,
    FinishReason,
    Request,
    RequestStatus,
    Role,
    SamplingParams,
    Unavailable,
)
from kvsched.core.slots import set_output
from kvsched.server.config.settings import ServerConfig
from kvsched.server.telemetry.metrics import Metrics
from kvsched.server.telemetry.otlp import KvschedSpanExporter
from kvsched.server.telemetry.tracing import Tracing, choose_exporters, make_resource, make_tracing
from kvsched.v1 import common_pb2

from .telemetry_harness import OtlpReceiver, Result, attributes, request, running_daemon

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's OTEL_* settings must not leak into these tests."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


def traceparent(i: int) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{TRACE_ID:032x}-{PARENT_ID + i:016x}-01"), ("tracestate", "kvt=1"))


def by_request_id(receiver: OtlpReceiver) -> dict[str, tuple[dict[str, Any], trace_pb2.Span]]:
    out = {}
    for res, span in receiver.spans():
        rid = attributes(span.attributes)["gen_ai.response.id"]
        assert rid not in out, f"two spans for {rid}"
        out[rid] = (res, span)
    return out


def event_times(span: trace_pb2.Span, name: str) -> list[int]:
    return [e.time_unix_nano for e in span.events if e.name == name]


# ---- tracing ---------------------------------------------------------------------------------


def test_request_spans_follow_the_client_trace_and_show_preemptions() -> None:
    """Tiny KV pool, long requests: preemptions happen; every span is the client's child."""
    receiver = OtlpReceiver()
    num = 6

    async def go() -> dict[str, Result]:
        overrides = {
            "tracing_exporter": "otlp",
            "otlp_endpoint": f"127.0.0.1:{receiver.port}",
            "otlp_headers": "x-api-key=secret",
            "model": "m1",
        }
        async with running_daemon(overrides, num_gpu_blocks=16, num_slots=8) as h:
            coros = [
                h.generate(request(f"r{i}", 40, 80, seed=i), traceparent(i)) for i in range(num)
            ]
            coros.append(h.generate(request("solo", 20, 5, seed=99)))  # no traceparent
            results = await asyncio.wait_for(asyncio.gather(*coros), 20)
        return {f"r{i}": r for i, r in enumerate(results[:num])} | {"solo": results[-1]}

    try:
        results = asyncio.run(go())
    finally:
        receiver.stop()

    spans = by_request_id(receiver)
    assert set(spans) == set(results)
    assert receiver.metadata[0].get("x-api-key") == "secret"
    total_preemptions = 0
    for rid, result in results.items():
        res, span = spans[rid]
        fin = result.finished
        assert fin is not None and fin.reason == common_pb2.FINISH_REASON_LENGTH
        assert res["service.name"] == "kvsched"
        assert res["service.version"] == kvsched.__version__
        assert span.name == "text_completion m1"
        assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
        assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET
        if rid == "solo":
            assert span.parent_span_id == b""  # a new trace
            assert span.trace_id != TRACE_ID.to_bytes(16, "big")
        else:
            assert span.trace_id == TRACE_ID.to_bytes(16, "big")
            assert span.parent_span_id == (PARENT_ID + int(rid[1:])).to_bytes(8, "big")
            assert span.trace_state == "kvt=1"

        attrs = attributes(span.attributes)
        max_tokens = 5 if rid == "solo" else 80
        assert attrs["gen_ai.request.model"] == "m1"
        assert attrs["gen_ai.request.max_tokens"] == max_tokens
        assert attrs["gen_ai.usage.input_tokens"] == fin.usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == fin.usage.output_tokens == len(result.tokens)
        assert fin.usage.output_tokens == max_tokens
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["kvsched.cached_tokens"] == fin.usage.cached_tokens
        assert attrs["kvsched.queue_time_s"] == pytest.approx(fin.timings.queue_s, abs=1e-9)
        assert attrs["kvsched.ttft_s"] == pytest.approx(fin.timings.ttft_s, abs=1e-9)
        assert attrs["kvsched.instance"] == "i0"
        duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
        assert duration == pytest.approx(fin.timings.e2e_s, abs=1e-6)

        names = [e.name for e in span.events]
        assert names[0] == "queued" and names[1] == "scheduled" and names[-1] == "finished"
        assert names.count("scheduled") == names.count("first_token") == 1
        (queued,) = event_times(span, "queued")
        (scheduled,) = event_times(span, "scheduled")
        (first,) = event_times(span, "first_token")
        (finished,) = event_times(span, "finished")
        assert span.start_time_unix_nano == queued < scheduled < first < finished
        assert finished == span.end_time_unix_nano
        times = [e.time_unix_nano for e in span.events]
        assert times == sorted(times)
        assert attributes(span.events[1].attributes) == {"kvsched.instance": "i0"}

        n = attrs["kvsched.num_preemptions"]
        total_preemptions += n
        swaps = [x for x in names if x in ("preempted", "resumed")]
        assert swaps.count("preempted") == n
        # Each preemption is followed by a resume, except a last one that the worker overtook
        # by finishing the request before it saw the preempt (the finish is kept).
        pairs = ["preempted", "resumed"] * n
        assert swaps in (pairs, pairs[:-1])
    assert total_preemptions > 0, "the test should have forced preemptions"


def test_error_finish_sets_span_status_and_abort_does_not() -> None:
    receiver = OtlpReceiver()

    async def go() -> Result:
        overrides = {
            "tracing_exporter": "otlp",
            "otlp_endpoint": f"127.0.0.1:{receiver.port}",
            "requeue_timeout_s": 0.0,  # a lost instance's requests fail at once
        }
        async with running_daemon(overrides, zero_cost=False) as h:
            lost = h.stub.Generate(request("lost", 16, 4000), metadata=traceparent(0))
            gone = h.stub.Generate(request("gone", 16, 4000, seed=1), metadata=traceparent(1))
            for call in (lost, gone):
                while (await call.read()).WhichOneof("kind") != "tokens":
                    pass
            gone.cancel()  # the client walks away: an abort

            async def gone_finished() -> None:
                while "gone" in h.daemon.tracked:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(gone_finished(), 10)
            await h.stop_worker()  # the instance is lost, nowhere to go: an error
            out = Result()
            while (r := await asyncio.wait_for(lost.read(), 10)) is not grpc.aio.EOF:
                if r.WhichOneof("kind") == "finished":
                    out.finished = r.finished
        return out

    try:
        lost_result = asyncio.run(go())
    finally:
        receiver.stop()

    assert lost_result.finished is not None
    assert lost_result.finished.reason == common_pb2.FINISH_REASON_ERROR
    spans = by_request_id(receiver)
    _, lost = spans["lost"]
    assert lost.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert lost.status.message == lost_result.finished.message and "lost" in lost.status.message
    assert attributes(lost.attributes)["gen_ai.response.finish_reasons"] == ["error"]
    _, gone = spans["gone"]
    assert gone.status.code == trace_pb2.Status.STATUS_CODE_UNSET
    assert attributes(gone.attributes)["gen_ai.response.finish_reasons"] == ["abort"]
    assert [e.name for e in gone.events][-1] == "finished"


def test_a_request_moved_off_a_lost_instance_keeps_its_span() -> None:
    receiver = OtlpReceiver()

    async def go() -> tuple[Result, str]:
        overrides = {"tracing_exporter": "otlp", "otlp_endpoint": f"127.0.0.1:{receiver.port}"}
        async with running_daemon(overrides, zero_cost=False, instances=("i0", "i1")) as h:
            call = h.stub.Generate(request("mv", 16, 300), metadata=traceparent(0))
            out, first = Result(), ""
            while (r := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                kind = r.WhichOneof("kind")
                if kind == "queued":
                    first = r.queued.instance
                elif kind == "tokens":
                    if not out.tokens:
                        await h.stop_worker(first)  # lose the instance mid-stream
                    out.tokens.extend(r.tokens.token_ids)
                elif kind == "finished":
                    out.finished = r.finished
        return out, first

    try:
        result, first = asyncio.run(go())
    finally:
        receiver.stop()

    other = "i1" if first == "i0" else "i0"
    assert result.finished is not None
    assert result.finished.reason == common_pb2.FINISH_REASON_LENGTH
    assert len(result.tokens) == 300
    _, span = by_request_id(receiver)["mv"]
    assert span.parent_span_id == PARENT_ID.to_bytes(8, "big")
    placed = [
        (e.name, attributes(e.attributes)["kvsched.instance"])
        for e in span.events
        if e.name in ("scheduled", "resumed")
    ]
    assert placed == [("scheduled", first), ("resumed", other)]
    attrs = attributes(span.attributes)
    assert attrs["kvsched.instance"] == other
    assert attrs["gen_ai.usage.output_tokens"] == 300
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET


def test_span_hooks_in_memory_moved_and_unsampled() -> None:
    """The hooks alone: an instance_lost event, resumed after it, no span for an unsampled
    client trace (parentbased sampling)."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracerProvider(), "m1")
    tracing.add_processor(SimpleSpanProcessor(exporter))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=time.monotonic())
    tr = SimpleNamespace(
        req=req, engine=SimpleNamespace(instance_id="i0"), instance_id="i0", span=None
    )
    req.tag = tr
    tracing.request_accepted(tr, dict(traceparent(0)))
    req.first_scheduled_time = time.monotonic()  # as the core stamps a placement
    tracing.lifecycle(tr.engine, Events(scheduled=[req]))
    moved = Request("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=req.arrival_time)
    moved.first_scheduled_time = req.first_scheduled_time  # as the daemon's requeue_lost copies
    moved.tag, tr.req = tr, moved
    tracing.request_moved(tr, "worker stream ended")
    tr.engine, tr.instance_id = SimpleNamespace(instance_id="i1"), "i1"
    tracing.lifecycle(tr.engine, Events(scheduled=[moved], first_token=[req]))  # req is stale
    moved.status, moved.finish_reason = RequestStatus.FINISHED_ABORTED, FinishReason.ABORT
    moved.finished_time = time.monotonic()
    tracing.request_finished(tr)

    unsampled = Request("b", [1], arrival_time=time.monotonic())
    tr2 = SimpleNamespace(req=unsampled, engine=tr.engine, instance_id="i1", span=None)
    tracing.request_accepted(tr2, {"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-00"})
    assert tr2.span is None

    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events] == [
        "queued", "scheduled", "instance_lost", "resumed", "finished"
    ]  # fmt: skip
    assert dict(span.events[2].attributes or {}) == {
        "kvsched.instance": "i0",
        "kvsched.reason": "worker stream ended",
    }
    assert span.attributes is not None and span.attributes["kvsched.instance"] == "i1"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.status.status_code.name == "UNSET"  # an abort is not an error


@pytest.mark.parametrize(
    ("sampler", "kept", "parent_kept"),
    [
        (DEFAULT_ON, True, True),
        (ALWAYS_ON, True, True),
        (ALWAYS_OFF, False, False),
        (ParentBased(ALWAYS_OFF), False, True),
        (TraceIdRatioBased(0.0), False, False),
        (ParentBasedTraceIdRatio(1.0), True, True),
    ],
)
def test_the_sampler_decides_root_spans(sampler: Any, kept: bool, parent_kept: bool) -> None:
    """Requests without a parent: the default and always_on samplers are known to keep them
    (the hook skips asking), any other sampler is asked."""
    tracing = Tracing(TracerProvider(sampler=sampler), "m1")
    exporter = InMemorySpanExporter()
    tracing.add_processor(SimpleSpanProcessor(exporter))
    req = Request("a", [1], SamplingParams(max_tokens=1), arrival_time=time.monotonic())
    tr = SimpleNamespace(
        req=req, engine=SimpleNamespace(instance_id="i0"), instance_id="i0", span=None
    )
    tracing.request_accepted(tr, {})
    assert (tr.span is not None) is kept
    tr2 = SimpleNamespace(req=req, engine=tr.engine, instance_id="i0", span=None)
    tracing.request_accepted(tr2, dict(traceparent(0)))  # a sampled parent: asked as before
    assert (tr2.span is not None) is parent_kept
    req.finished_time = time.monotonic()
    tracing.request_finished(tr)
    tracing.request_finished(tr2)
    spans = exporter.get_finished_spans()
    assert len(spans) == kept + parent_kept
    if kept:
        ctx = spans[0].context
        assert ctx is not None and ctx.is_valid and ctx.trace_flags.sampled and not ctx.is_remote
        assert ctx.trace_state == TraceState() and spans[0].parent is None
    if parent_kept:
        ctx = spans[-1].context
        assert ctx is not None and ctx.trace_id == TRACE_ID
        assert ctx.trace_state.to_header() == "kvt=1"
        assert spans[-1].parent is not None and spans[-1].parent.span_id == PARENT_ID


def test_standard_otel_environment_variables_configure_tracing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=t1")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "fleet-a")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def one(req_id: str) -> None:
        async with running_daemon({}) as h:  # tracing_exporter left at its default, none
            await h.generate(request(req_id, 8, 2))

    try:
        asyncio.run(one("sampled-out"))
        assert receiver.spans() == []  # always_off: nothing exported
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
        asyncio.run(one("env"))
    finally:
        receiver.stop()
    ((resource, span),) = receiver.spans()
    assert resource["service.name"] == "fleet-a"
    assert attributes(span.attributes)["gen_ai.response.id"] == "env"
    assert receiver.metadata[0].get("x-tenant") == "t1"


def test_exporter_choice_config_then_environment() -> None:
    assert choose_exporters("none", {}) == []
    assert choose_exporters("otlp", {"OTEL_TRACES_EXPORTER": "console"}) == ["otlp"]
    assert choose_exporters("none", {"OTEL_TRACES_EXPORTER": "otlp"}) == ["otlp"]
    assert choose_exporters("none", {"OTEL_TRACES_EXPORTER": "otlp, console,zipkin"}) == [
        "otlp",
        "console",
    ]
    assert choose_exporters("none", {"OTEL_TRACES_EXPORTER": "none"}) == []
    assert choose_exporters("console", {"OTEL_SDK_DISABLED": "true"}) == []
    assert make_tracing(ServerConfig().validate(), environ={}) is None


def test_service_name_config_then_otel_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServerConfig(instances={}).validate()
    assert make_resource(config).attributes["service.name"] == "kvsched"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "fleet-a")
    assert make_resource(config).attributes["service.name"] == "fleet-a"
    config.service_name = "mine"
    assert make_resource(config).attributes["service.name"] == "mine"


# ---- metrics ---------------------------------------------------------------------------------


def scrape(
    port: int, path: str = "/metrics"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"instance": "i0", "model": "m1", **labels}.items())))
    return m.get(key, 0.0)


def test_metrics_counters_move_by_exactly_what_was_sent() -> None:
    # (prompt length, max_tokens); r3 repeats r0's prompt, so it hits the prefix cache.
    shapes = [(40, 7), (23, 12), (64, 3), (40, 9), (5, 2)]

    async def go() -> tuple[dict[Any, float], dict[Any, float], list[Result], int]:
        overrides = {"metrics_listen": "127.0.0.1:0", "model": "m1"}
        async with running_daemon(overrides, num_gpu_blocks=512) as h:
            port = await h.daemon.telemetry.start_metrics_server()
            assert port
            before = await asyncio.to_thread(scrape, port)
            results = []
            for i, (p, n) in enumerate(shapes):  # one at a time: r3 sees r0's cached blocks
                seed = 0 if i == 3 else i
                results.append(await asyncio.wait_for(h.generate(request(f"m{i}", p, n, seed)), 10))
            after = await asyncio.to_thread(scrape, port)
            with pytest.raises(urllib.error.HTTPError) as err:
                await asyncio.to_thread(scrape, port, "/nope")
            assert err.value.code == 404
        return before, after, results, port

    before, after, results, _ = asyncio.run(go())

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    n = len(shapes)
    prompt = sum(p for p, _ in shapes)
    generated = sum(t for _, t in shapes)
    assert [len(r.tokens) for r in results] == [t for _, t in shapes]
    assert delta("kvsched_generation_tokens_total") == generated
    assert delta("kvsched_prompt_tokens_total") == prompt
    assert delta("kvsched_request_success_total", finished_reason="length") == n
    assert delta("kvsched_request_success_total", finished_reason="stop") == 0
    cached = sum(r.finished.usage.cached_tokens for r in results if r.finished)
    assert cached > 0
    assert delta("kvsched_prefix_cache_queries_total") == prompt
    assert delta("kvsched_prefix_cache_hits_total") == cached
    assert delta("kvsched_num_preemptions_total") == 0

    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"kvsched_{hist}_seconds_count") == n
    assert delta("kvsched_time_per_output_token_seconds_count") == n
    # One observation per decode token: every output token but each request's first.
    assert delta("kvsched_inter_token_latency_seconds_count") == generated - n
    assert delta("kvsched_batch_size_count") >= 1
    assert delta("kvsched_scheduler_step_seconds_count") >= 1
    fins = [r.finished for r in results if r.finished]
    e2e = sum(f.timings.e2e_s for f in fins)
    ttft = sum(f.timings.ttft_s for f in fins)
    assert delta("kvsched_e2e_request_latency_seconds_sum") == pytest.approx(e2e, abs=1e-9)
    assert delta("kvsched_time_to_first_token_seconds_sum") == pytest.approx(ttft, abs=1e-9)
    ttft_buckets = [
        v for (name, _), v in after.items() if name.endswith("first_token_seconds_bucket")
    ]
    assert max(ttft_buckets) == sample(after, "kvsched_time_to_first_token_seconds_count")

    assert sample(after, "kvsched_num_requests_running") == 0
    assert sample(after, "kvsched_num_requests_waiting") == 0
    assert sample(after, "kvsched_kv_cache_usage_perc") == 0.0
    assert sample(after, "kvsched_num_free_blocks") == 512


def test_metrics_address_in_use_is_a_clear_error() -> None:
    async def go() -> None:
        first = Metrics("m1")
        port = await first.start_server("127.0.0.1:0")
        try:
            with pytest.raises(Unavailable, match=f"127.0.0.1:{port}.*--metrics-listen"):
                await Metrics("m1").start_server(f"127.0.0.1:{port}")
        finally:
            first.close()

    asyncio.run(go())


def test_spans_are_built_off_the_loop_and_keep_rare_events_in_order() -> None:
    """The real batch processor and OTLP exporter to the in-process receiver: the finished
    span waits in the batch queue unbuilt (no ids, attributes or events made on the event
    loop); once exported it has the client's parent, its placement and first token read from
    the core Request's times, and the rare events (preempted, resumed; a hand-off's placements
    on prefill and decode instances) in order."""
    receiver = OtlpReceiver()
    tracing = Tracing(TracerProvider(), "m1")
    processor = BatchSpanProcessor(
        KvschedSpanExporter(endpoint=f"http://127.0.0.1:{receiver.port}"),
        schedule_delay_millis=60_000,
    )
    tracing.add_processor(processor)
    mixed = SimpleNamespace(instance_id="i0")
    try:
        req = Request("p", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=time.monotonic())
        tr = SimpleNamespace(req=req, engine=mixed, instance_id="i0", span=None)
        req.tag = tr
        tracing.request_accepted(tr, dict(traceparent(3)))
        req.first_scheduled_time = time.monotonic()
        tracing.lifecycle(mixed, Events(scheduled=[req]))
        req.first_token_time = time.monotonic()
        tracing.lifecycle(mixed, Events(first_token=[req]))
        req.num_preemptions = 1
        tracing.lifecycle(mixed, Events(preempted=[req]))
        tracing.lifecycle(mixed, Events(scheduled=[req]))
        req.finish_reason, req.finished_time = FinishReason.LENGTH, time.monotonic()
        set_output(req, [5, 6, 7, 8])
        req.num_draft_tokens, req.num_accepted_drafts = 10, 4  # speculative decoding's counts
        tracing.request_finished(tr)

        prefill = SimpleNamespace(instance_id="p0", role=Role.PREFILL)
        decode = SimpleNamespace(instance_id="d0", role=Role.DECODE)
        pd = Request("pd", [1], SamplingParams(max_tokens=2), arrival_time=time.monotonic())
        tr2 = SimpleNamespace(req=pd, engine=prefill, instance_id="p0", span=None)
        pd.tag = tr2
        tracing.request_accepted(tr2, {})
        pd.first_scheduled_time = time.monotonic()
        tracing.lifecycle(prefill, Events(scheduled=[pd]))
        pd.first_token_time = time.monotonic()
        tracing.lifecycle(prefill, Events(first_token=[pd]))
        tr2.engine, tr2.instance_id = decode, "d0"  # handed off: the decode instance places it
        tracing.lifecycle(decode, Events(scheduled=[pd]))
        pd.finish_reason, pd.finished_time = FinishReason.STOP, time.monotonic()
        tracing.request_finished(tr2)
        tracing.request_finished(tr2)  # once only

        queued = list(processor._batch_processor._queue)
        assert len(queued) == 2 and all("_context" not in s.__dict__ for s in queued)
        assert tr.span is None and tr2.span is None
    finally:
        tracing.shutdown()  # the batch goes out now (flush at shutdown)
        receiver.stop()

    spans = by_request_id(receiver)
    _, span = spans["p"]
    assert span.trace_id == TRACE_ID.to_bytes(16, "big")
    assert span.parent_span_id == (PARENT_ID + 3).to_bytes(8, "big")
    assert span.trace_state == "kvt=1"
    names = [e.name for e in span.events]
    assert names == ["queued", "scheduled", "first_token", "preempted", "resumed", "finished"]
    times = [e.time_unix_nano for e in span.events]
    assert times == sorted(times) and times[0] == span.start_time_unix_nano
    assert times[1] == tracing.wall_ns(req.first_scheduled_time)  # the placement's time
    assert attributes(span.events[3].attributes) == {
        "kvsched.instance": "i0",
        "kvsched.num_preemptions": 1,
    }
    assert attributes(span.attributes)["kvsched.num_preemptions"] == 1
    assert attributes(span.attributes)["gen_ai.usage.output_tokens"] == 4
    spec = {k: v for k, v in attributes(span.attributes).items() if "spec_decode" in k}
    assert spec == {
        "kvsched.spec_decode.draft_tokens": 10,
        "kvsched.spec_decode.accepted_tokens": 4,
        "kvsched.spec_decode.acceptance_rate": 0.4,
    }

    _, span = spans["pd"]
    assert span.parent_span_id == b"" and len(span.trace_id) == 16
    placed = [
        (e.name, attributes(e.attributes).get("kvsched.instance"))
        for e in span.events
        if e.name != "finished"
    ]
    assert placed == [
        ("queued", None),
        ("scheduled", "p0"),
        ("first_token", None),
        ("resumed", "d0"),
    ]
    assert attributes(span.attributes)["kvsched.instance"] == "d0"
    assert not [k for k in attributes(span.attributes) if "spec_decode" in k]  # no drafts


def test_spans_of_finished_and_open_requests_are_exported_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No export before shutdown (OTEL_BSP_SCHEDULE_DELAY is long, the batch not full): the
    shutdown flush sends every finished request's span, and that of a request whose instance
    was lost at the end (end_open's daemon_shutdown itself: test_otlp_encode's daemon_spans)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    receiver = OtlpReceiver()
    num = 12

    async def go() -> list[Result]:
        overrides = {
            "tracing_exporter": "otlp",
            "otlp_endpoint": f"127.0.0.1:{receiver.port}",
            "requeue_timeout_s": 600.0,  # its worker stops first: it waits to be placed again
        }
        async with running_daemon(overrides, zero_cost=False) as h:
            done = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        h.generate(request(f"f{i}", 8, 3, seed=i), traceparent(i))
                        for i in range(num)
                    )
                ),
                20,
            )
            call = h.stub.Generate(request("open", 16, 4000), metadata=traceparent(99))
            while (await asyncio.wait_for(call.read(), 10)).WhichOneof("kind") != "tokens":
                pass
            assert receiver.spans() == []  # nothing exported yet
        return done

    try:
        done = asyncio.run(go())
    finally:
        receiver.stop()

    spans = by_request_id(receiver)
    assert set(spans) == {f"f{i}" for i in range(num)} | {"open"}
    for i, result in enumerate(done):
        _, span = spans[f"f{i}"]
        assert result.finished is not None
        assert span.parent_span_id == (PARENT_ID + i).to_bytes(8, "big")
        assert [e.name for e in span.events] == [
            "queued", "scheduled", "first_token", "finished"
        ]  # fmt: skip
    _, span = spans["open"]
    names = [e.name for e in span.events]
    # the server's stop cancels its stream (an abort) before telemetry's shutdown would end it
    assert names[:4] == ["queued", "scheduled", "first_token", "instance_lost"]
    assert names[-1] in ("finished", "daemon_shutdown") and len(names) == 5
    assert span.parent_span_id == (PARENT_ID + 99).to_bytes(8, "big")


def test_a_pending_span_builds_every_field_the_installed_sdk_gives_a_readable_span() -> None:
    # PendingSpan makes ReadableSpan's fields itself (lazily, off the event loop); an SDK
    # release that adds one would otherwise fail inside the exporter, dropping whole batches.
    # The batch queue's `emit` it calls directly must still be there (else it falls back to
    # on_end, which is correct but builds the span on the loop).
    from opentelemetry.sdk.trace import ReadableSpan

    from kvsched.server.telemetry import spans as tracing_mod

    assert set(vars(ReadableSpan(name="probe"))) == set(tracing_mod._SPAN_FIELDS)
    processor = BatchSpanProcessor(InMemorySpanExporter())
    try:
        sink = tracing_mod._enqueue(processor)
        assert getattr(sink, "__self__", None) is not processor, "fell back to on_end"
    finally:
        processor.shutdown()
