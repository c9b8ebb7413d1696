"""`routing_overload = "refuse"` through the real daemon (issue 25): with two real sim workers,
a request whose deadline no instance is predicted to meet is refused with RESOURCE_EXHAUSTED, a
retry hint in its message and the error type in the trailers, counted as refused; one that
can meet its deadline is served; under the default (`demote`) the same request is served."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
from prometheus_client import generate_latest

from kvsched.server.errors import ERROR_TYPE_KEY
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from tests.server.telemetry_harness import running_daemon

PROMPT = list(range(3, 3 + 4096))  # long: its own prefill is predicted to take far over 1 ms


def _req(rid: str, deadline_ms: int) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=2),
        ttft_deadline_ms=deadline_ms,
    )


def test_refuse_overload_policy_refuses_with_a_retry_hint_through_the_daemon() -> None:
    async def go() -> tuple[grpc.aio.AioRpcError, bool, str]:
        overrides = {"routing_overload": "refuse"}
        async with running_daemon(overrides, instances=("i0", "i1"), zero_cost=False) as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(_req("late-1", 1))
            served = await h.generate(_req("fine-1", 600_000))
            metrics = generate_latest(h.daemon.telemetry.metrics.registry).decode()
            return err.value, served.finished is not None, metrics

    err, served, metrics = asyncio.run(go())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    msg = err.details() or ""
    assert "late-1" in msg and "first token after 1 ms" in msg, msg
    assert re.search(r"retry in \d+ s or elsewhere", msg), msg
    trailers = dict(err.trailing_metadata() or ())
    assert trailers.get(ERROR_TYPE_KEY) == "CapacityExceeded"
    assert served, "a request that can meet its deadline is served"
    assert re.search(
        r'kvsched_requests_refused_total\{[^}]*reason="resource_exhausted"\} 1\.0', metrics
    ), [ln for ln in metrics.splitlines() if "refused" in ln]


def test_default_demote_policy_serves_the_same_request() -> None:
    async def go() -> bool:
        async with running_daemon({}, instances=("i0", "i1"), zero_cost=False) as h:
            out = await h.generate(_req("late-2", 1))
            return out.finished is not None

    assert asyncio.run(go())
