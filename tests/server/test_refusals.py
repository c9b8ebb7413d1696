"""Refused requests are observable: kvsched_requests_refused_total{reason}, one INFO log line
with the request id and the reason, and a span with error status (the real OpenTelemetry SDK,
an in-memory exporter), for each refusal of a real daemon with a real sim worker."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from tests.server.telemetry_harness import running_daemon


def _req(rid: str, prompt: list[int], **kw: object) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=4),
        **kw,  # type: ignore[arg-type]
    )


def test_refusals_are_counted_logged_and_traced(caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()

    async def go() -> bytes:
        async with running_daemon({"tracing_exporter": "console"}) as h:
            tracing = h.daemon.telemetry.tracing
            assert tracing is not None
            tracing.add_processor(SimpleSpanProcessor(exporter))
            for msg, code in (
                (_req("empty-1", []), grpc.StatusCode.INVALID_ARGUMENT),
                (_req("long-1", [1] * 200_000), grpc.StatusCode.INVALID_ARGUMENT),
                (_req("model-1", [1, 2], model="nope"), grpc.StatusCode.NOT_FOUND),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await h.generate(msg)
                assert e.value.code() == code
            ok = await h.generate(_req("fine-1", [1, 2, 3]))
            assert ok.finished is not None
            return generate_latest(h.daemon.telemetry.metrics.registry)

    with caplog.at_level(logging.INFO, logger="kvsched.daemon"):
        scraped = asyncio.run(go()).decode()

    assert 'kvsched_requests_refused_total{model="default",reason="invalid_argument"} 2.0' in (
        scraped
    )
    assert 'kvsched_requests_refused_total{model="default",reason="not_found"} 1.0' in scraped
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    for rid, reason in (
        ("empty-1", "invalid_argument"),
        ("long-1", "invalid_argument"),
        ("model-1", "not_found"),
    ):
        (line,) = [ln for ln in lines if rid in ln]
        assert f"({reason})" in line
        assert all(r.levelname == "INFO" for r in caplog.records if rid in r.getMessage())
    assert not any("fine-1" in ln for ln in lines)
    spans = {s.attributes["kvsched.request_id"]: s for s in exporter.get_finished_spans()
             if s.attributes and "kvsched.refused" in s.attributes}  # fmt: skip
    assert set(spans) == {"empty-1", "long-1", "model-1"}
    for span in spans.values():
        assert span.status.status_code.name == "ERROR"
        assert span.status.description
    assert "max_model_len" in spans["long-1"].status.description
