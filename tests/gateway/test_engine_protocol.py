"""The engine protocol (`vllm.grpc.engine.VllmEngine`, smg-grpc-proto) on a real daemon with sim
workers, called as the gateway calls it: health and model info, the tokenizer archive, loads,
Generate streamed and not, Abort ending the stream, fields refused by name, the caller's
bearer token and trace context."""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from kvsched.v1 import request_service_pb2 as rpb
from kvsched.v1.request_service_pb2_grpc import RequestServiceStub
from tests.http.harness import make_model_dir, wait_ready
from tests.integration.harness import child_env, start_daemon, start_worker
from tests.server.telemetry_harness import OtlpReceiver, running_daemon

pb = vllm_engine_pb2
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
PARENT_ID = 0xB7AD6B7169203331


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


@asynccontextmanager
async def engine(overrides: dict[str, Any], **kw: Any) -> AsyncIterator[Any]:
    async with running_daemon(overrides, **kw) as h:
        yield h, vllm_engine_pb2_grpc.VllmEngineStub(h.channel)


def generate(rid: str, n_prompt: int, max_tokens: int, stream: bool, **sp: Any) -> Any:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=list(range(1, n_prompt + 1))),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sp),
        stream=stream,
    )


def test_health_model_info_tokenizer_and_loads(model_dir: Path) -> None:
    async def go() -> None:
        async with engine({"tokenizer": str(model_dir), "model": "tiny"}) as (_, stub):
            health = await stub.HealthCheck(pb.HealthCheckRequest())
            assert health.healthy, health.message
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.served_model_name == "tiny"
            assert info.tokenizer_path == str(model_dir)
            assert info.max_context_length > 0 and info.is_generation
            data, sha = b"", ""
            async for piece in stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
                data += piece.data
                sha = piece.sha256 or sha
            assert sha == hashlib.sha256(data).hexdigest()
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                assert zf.read("tokenizer.json") == (model_dir / "tokenizer.json").read_bytes()
                assert (
                    zf.read("tokenizer_config.json")
                    == (model_dir / "tokenizer_config.json").read_bytes()
                )
            call = stub.Generate(generate("busy", 8, 100000, True, ignore_eos=True))
            await call.read()  # running now
            loads = await stub.GetLoads(pb.GetLoadsRequest())
            assert loads.dp_rank_count == 1
            assert loads.loads[0].num_running_reqs == 1
            assert loads.loads[0].max_total_num_tokens == 512 * 16
            call.cancel()
            server = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert server.server_type == "kvsched" and server.block_size == 16

    asyncio.run(go())


def test_no_tokenizer_is_failed_precondition_naming_the_flag() -> None:
    async def go() -> None:
        async with engine({}) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.GetTokenizer(common_pb2.GetTokenizerRequest()):
                    pass
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--tokenizer" in (exc.value.details() or "")

    asyncio.run(go())


def test_generate_whole_and_streamed_agree_with_usage_and_matched_stop() -> None:
    async def go() -> None:
        async with engine({}) as (_, stub):
            whole = [m async for m in stub.Generate(generate("a", 20, 9, False, ignore_eos=True))]
            assert [m.WhichOneof("response") for m in whole] == ["complete"]
            done = whole[0].complete
            assert done.finish_reason == "length" and len(done.output_ids) == 9
            assert (done.prompt_tokens, done.completion_tokens) == (20, 9)
            streamed = [m async for m in stub.Generate(generate("a", 20, 9, True, ignore_eos=True))]
            kinds = [m.WhichOneof("response") for m in streamed]
            assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
            ids = [t for m in streamed[:-1] for t in m.chunk.token_ids]
            assert ids == list(done.output_ids)  # the sim's tokens follow the request id
            assert sum(m.chunk.completion_tokens for m in streamed[:-1]) == 9
            end = streamed[-1].complete
            assert (end.finish_reason, end.completion_tokens, end.prompt_tokens) == (
                "length",
                9,
                20,
            )
            # A stop token id the output holds: it ends there, named as matched.
            stop = done.output_ids[4]
            first = list(done.output_ids).index(stop)
            cut = [
                m async for m in stub.Generate(generate("a", 20, 9, False, stop_token_ids=[stop]))
            ]
            c = cut[0].complete
            assert c.finish_reason == "stop" and c.matched_token_id == stop
            assert list(c.output_ids) == list(done.output_ids[: first + 1])

    asyncio.run(go())


def test_abort_ends_the_generate_stream_within_a_second() -> None:
    async def go() -> None:
        async with engine({}, zero_cost=False) as (h, stub):
            call = stub.Generate(generate("long", 16, 100000, True, ignore_eos=True))
            first = await call.read()
            assert first.WhichOneof("response") == "chunk"
            t0 = time.monotonic()
            await stub.Abort(pb.AbortRequest(request_ids=["long", "never-seen"]))
            last = None
            while (m := await call.read()) is not grpc.aio.EOF:  # chunks, then the complete
                last = m
            took = time.monotonic() - t0
            assert last is not None and last.complete.finish_reason == "abort"
            assert took < 1.0, took
            assert "long" not in h.daemon.requests.tracked

    asyncio.run(go())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"n": 2}, "sampling_params.n"),
        ({"logprobs": 1}, "sampling_params.logprobs"),
        ({"presence_penalty": 0.5}, "sampling_params.presence_penalty"),
        ({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty"),
        ({"logit_bias": {3: 1.0}}, "sampling_params.logit_bias"),
        ({"json_schema": "{}"}, "sampling_params.json_schema"),
        ({"seed": -1}, "sampling_params.seed"),
        ({"text": "hi"}, "GenerateRequest.text"),
    ],
)
def test_fields_kvsched_cannot_honour_are_refused_by_name(
    change: dict[str, Any], needle: str
) -> None:
    async def go() -> None:
        async with engine({}) as (h, stub):
            req = generate("x", 8, 4, False)
            if "text" in change:
                req.text = change["text"]
            else:
                for k, v in change.items():
                    if k == "logit_bias":
                        req.sampling_params.logit_bias.update(v)
                    else:
                        setattr(req.sampling_params, k, v)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(req):
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in (exc.value.details() or "")
            assert not h.daemon.requests.tracked

    asyncio.run(go())


def test_over_long_prompt_is_invalid_argument_naming_the_limit() -> None:
    async def go() -> None:
        async with engine({"engine.scheduler.max_model_len": 256}) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in stub.Generate(generate("big", 300, 4, True)):
                    pass
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "256" in (exc.value.details() or "")

    asyncio.run(go())


def test_traceparent_parents_the_request_span() -> None:
    receiver = OtlpReceiver()
    trace = (("traceparent", f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"),)

    async def go() -> None:
        overrides = {"tracing_exporter": "otlp", "otlp_endpoint": f"127.0.0.1:{receiver.port}"}
        async with engine(overrides) as (_, stub):
            got = [m async for m in stub.Generate(generate("t", 8, 3, False), metadata=trace)]
            assert got[-1].complete.finish_reason == "length"

    try:
        asyncio.run(go())
    finally:
        receiver.stop()
    spans = [s for _, s in receiver.spans()]
    assert len(spans) == 1
    assert spans[0].trace_id == TRACE_ID.to_bytes(16, "big")
    assert spans[0].parent_span_id == PARENT_ID.to_bytes(8, "big")


def test_the_callers_bearer_token_meets_kvsched_auth(tmp_path: Path) -> None:
    """The service needs the `client` role, like RequestService; the token's principal owns
    the request, so another client's Abort does not reach it."""
    auth = tmp_path / "auth"
    auth.write_text(
        "client gateway-secret-0123456789\nclient other-client-0123456789\n"
        "worker worker-secret-0123456789\nadmin admin-secret-0123456789\n"
    )
    daemon, address = start_daemon("--auth-file", str(auth))
    procs = [daemon]
    try:
        procs.append(start_worker(address, "i0", "--token", "worker-secret-0123456789"))
        wait_ready(address, "admin-secret-0123456789")
        token = (("authorization", "Bearer gateway-secret-0123456789"),)
        other = (("authorization", "Bearer other-client-0123456789"),)
        with grpc.insecure_channel(address) as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as exc:
                stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.HealthCheck(pb.HealthCheckRequest(), metadata=token, timeout=5).healthy
            call = stub.Generate(generate("mine", 8, 100000, True, ignore_eos=True), metadata=token)
            assert next(call).WhichOneof("response") == "chunk"
            stub.Abort(pb.AbortRequest(request_ids=["mine"]), metadata=other, timeout=5)
            assert next(call).WhichOneof("response") == "chunk"  # still running
            stub.Abort(pb.AbortRequest(request_ids=["mine"]), metadata=token, timeout=5)
            assert [m for m in call][-1].complete.finish_reason == "abort"
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_daemon_serves_without_the_gateway_extra() -> None:
    """smg-grpc-proto absent (its import fails): the daemon starts and serves its own services;
    the engine protocol is not there (UNIMPLEMENTED)."""
    code = (
        "import sys; sys.modules['smg_grpc_proto'] = None; from kvsched.cli import main; "
        "sys.exit(main(['serve', '--listen', '127.0.0.1:0', '--metrics-listen', 'off']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := re.search(r"kvsched listening on (\S+:\d+)", line):
                break
        else:
            raise AssertionError("the daemon did not start")
        with grpc.insecure_channel(m.group(1)) as ch:
            models = RequestServiceStub(ch).ListModels(rpb.ListModelsRequest(), timeout=5)
            assert list(models.models) == []
            with pytest.raises(grpc.RpcError) as exc:
                vllm_engine_pb2_grpc.VllmEngineStub(ch).HealthCheck(
                    pb.HealthCheckRequest(), timeout=5
                )
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.terminate()
        proc.wait(timeout=30)
