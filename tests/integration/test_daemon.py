"""The daemon end to end: real `kvsched serve` and `kvsched worker` processes on loopback."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import Outcome, Spec, generate, mixed_specs, run
from tests.integration.harness import start_daemon, start_worker, status, wait_pool_free, wait_ready

LENGTH, STOP, ABORT = (
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_ABORT,
)


@pytest.fixture(scope="module")
def one_worker():
    daemon, address = start_daemon()
    worker = start_worker(
        address, "i0", "--zero-cost", "--num-blocks", "3000", "--num-slots", "128"
    )
    try:
        wait_ready(address, ["i0"])
        yield address
    finally:
        worker.stop()
        daemon.stop()


def check_outcomes(specs: list[Spec], outcomes: list[Outcome]) -> None:
    for spec, out in zip(specs, outcomes, strict=True):
        assert out.code is None, (spec.req_id, out.code, out.details)
        assert out.finished is not None, spec.req_id
        want = spec.expected
        assert out.tokens == want, spec.req_id
        f = out.finished
        # Length is checked before stop tokens (as vLLM does): a stop token that is also the
        # max_tokens-th token ends the request with LENGTH.
        stopped = len(want) < spec.max_tokens
        assert f.reason == (STOP if stopped else LENGTH), spec.req_id
        assert f.usage.prompt_tokens == len(spec.prompt)
        assert f.usage.output_tokens == len(want)
        assert 0 <= f.usage.cached_tokens < len(spec.prompt)
        assert 0 <= f.timings.queue_s <= f.timings.ttft_s <= f.timings.e2e_s and f.timings.e2e_s > 0


def test_500_concurrent_generate_streams(one_worker: str) -> None:
    specs = mixed_specs(500, seed=1)

    async def go() -> list[Outcome]:
        async with grpc.aio.insecure_channel(one_worker) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            return await asyncio.gather(*(generate(stub, s.message()) for s in specs))

    outcomes = run(go())
    check_outcomes(specs, outcomes)
    assert sum(o.finished.usage.cached_tokens for o in outcomes) > 0, "shared prefixes never hit"
    wait_pool_free(one_worker)


def test_500_requests_through_one_session(one_worker: str) -> None:
    specs = mixed_specs(500, seed=2)

    async def go() -> dict[str, Outcome]:
        results = {s.req_id: Outcome(req_id=s.req_id) for s in specs}
        async with grpc.aio.insecure_channel(one_worker) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)

            async def requests():
                for s in specs:
                    yield rpb.SessionRequest(
                        submit=rpb.SessionRequest.Submit(request=s.message(), client_tag=s.req_id)
                    )

            batches = rows = widest = 0
            async for msg in stub.Session(requests()):
                batches += 1
                rows += len(msg.tokens.request_ids)
                widest = max(widest, len(msg.tokens.request_ids))
                assert not msg.errors, msg.errors
                for rid, tag, inst in zip(
                    msg.accepted.request_ids,
                    msg.accepted.client_tags,
                    msg.accepted.instances,
                    strict=True,
                ):
                    assert rid == tag
                    results[rid].instance = inst
                pos = 0
                for rid, n in zip(msg.tokens.request_ids, msg.tokens.num_tokens, strict=True):
                    results[rid].tokens.extend(msg.tokens.token_ids[pos : pos + n])
                    pos += n
                for f in msg.finished:
                    assert results[f.request_id].finished is None, "finished twice"
                    results[f.request_id].finished = f
            # One message per engine step carries every request's tokens of that step (how
            # many steps there are depends on how fast the zero-cost worker runs).
            assert widest >= 10 and rows >= batches, (batches, rows, widest)
        return results

    results = run(go())
    check_outcomes(specs, [results[s.req_id] for s in specs])
    wait_pool_free(one_worker)


def test_abort_waiting_running_and_dropped_stream(one_worker: str) -> None:
    long = Spec("long-running", list(range(10, 60)), 4000 - 60)

    async def go() -> None:
        async with grpc.aio.insecure_channel(one_worker) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            call = stub.Generate(long.message())
            queued = await call.read()
            assert queued.queued.request_id == "long-running"
            first = await call.read()
            assert first.WhichOneof("kind") == "tokens"
            await stub.Abort(rpb.AbortRequest(request_id="long-running"))
            tokens = list(first.tokens.token_ids)
            while (r := await call.read()) is not grpc.aio.EOF:
                if r.WhichOneof("kind") == "tokens":
                    tokens.extend(r.tokens.token_ids)
                else:
                    fin = r.finished
            assert fin.reason == ABORT and fin.usage.output_tokens == len(tokens) < long.max_tokens
            assert tokens == long.expected[: len(tokens)]
            # Unknown id: NOT_FOUND with a message; a second abort of a finished one is a no-op.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Abort(rpb.AbortRequest(request_id="never-submitted"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            await stub.Abort(rpb.AbortRequest(request_id="long-running"))
            # A client that drops its stream aborts its request.
            call2 = stub.Generate(Spec("dropped", list(range(5, 40)), 3000).message())
            await call2.read()
            await call2.read()
            call2.cancel()

    run(go())
    wait_pool_free(one_worker)


def test_abort_of_a_waiting_request() -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "w", "--zero-cost", "--num-slots", "1", "--num-blocks", "200")
    try:
        wait_ready(address, ["w"])

        async def go() -> None:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                hog = stub.Generate(Spec("hog", [7] * 20, 3000).message())
                await hog.read()
                await hog.read()  # running: the one slot is taken
                waiting = asyncio.ensure_future(
                    generate(stub, Spec("waiter", [9] * 20, 5).message())
                )
                while status(address).num_waiting < 1:
                    await asyncio.sleep(0.02)
                await stub.Abort(rpb.AbortRequest(request_id="waiter"))
                out = await waiting
                assert out.finished.reason == ABORT and out.tokens == []
                assert out.finished.timings.ttft_s == 0
                hog.cancel()

        run(go())
        wait_pool_free(address)
    finally:
        worker.stop()
        daemon.stop()


def test_two_instances_route_by_cached_prefix() -> None:
    daemon, address = start_daemon()
    workers = [start_worker(address, i, "--zero-cost", "--num-blocks", "2000") for i in ("a", "b")]
    try:
        wait_ready(address, ["a", "b"])
        prefix = list(range(1000, 1000 + 512))

        async def go() -> None:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                warm = await generate(stub, Spec("warm", prefix + [1], 2).message())
                home = warm.instance
                outs = await asyncio.gather(
                    *(
                        generate(stub, Spec(f"f{i}", prefix + [i + 2], 2).message())
                        for i in range(8)
                    )
                )
                for o in outs:
                    assert o.instance == home, "a request sharing a long cached prefix moved away"
                    assert o.finished.usage.cached_tokens >= 496
                other = await asyncio.gather(
                    *(generate(stub, Spec(f"o{i}", [i + 5] * 300, 400).message()) for i in range(2))
                )
                assert {o.instance for o in other} <= {"a", "b"}

        run(go())
        wait_pool_free(address)
    finally:
        for w in workers:
            w.stop()
        daemon.stop()


@pytest.mark.parametrize(
    ("msg", "code", "needle"),
    [
        (rpb.GenerateRequest(prompt_token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (
            rpb.GenerateRequest(
                prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=0)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        (
            rpb.GenerateRequest(
                prompt_token_ids=[1] * 100,
                sampling=common_pb2.SamplingParams(max_tokens=10_000_000),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_model_len",
        ),
        (
            rpb.GenerateRequest(prompt_token_ids=[1, -5]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token ids",
        ),
        (
            rpb.GenerateRequest(
                prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(top_p=0.0)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            rpb.GenerateRequest(prompt_token_ids=[1, 2], model="other-model"),
            grpc.StatusCode.NOT_FOUND,  # naming the served models (issue 21)
            "unknown model",
        ),
    ],
)
def test_bad_input_gets_its_status_and_the_daemon_keeps_serving(one_worker, msg, code, needle):
    async def go() -> None:
        async with grpc.aio.insecure_channel(one_worker) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            bad = await generate(stub, msg)
            assert bad.code == code and needle in bad.details, (bad.code, bad.details)
            good = await generate(stub, Spec(f"after-{needle}", [3, 4, 5], 3).message())
            assert good.finished is not None and good.finished.reason == LENGTH

    run(go())


def test_duplicate_live_request_id_is_rejected(one_worker: str) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(one_worker) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            first = stub.Generate(Spec("dup", [1] * 10, 3000).message())
            await first.read()
            second = await generate(stub, Spec("dup", [1] * 10, 3).message())
            assert (
                second.code == grpc.StatusCode.INVALID_ARGUMENT
                and "already in use" in second.details
            )
            first.cancel()

    run(go())


def test_sigterm_under_load_finishes_every_request_and_exits_zero() -> None:
    daemon, address = start_daemon("--config", _write_grace_config(0.5))
    worker = start_worker(address, "i0", "--speed", "20", "--num-blocks", "3000")
    try:
        wait_ready(address, ["i0"])
        specs = [Spec(f"t{i}", [i + 3] * 50, 2000 if i % 2 else 4) for i in range(40)]

        async def go() -> list[Outcome]:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                queued = [asyncio.Event() for _ in specs]
                tasks = [
                    asyncio.ensure_future(generate(stub, s.message(), queued=q))
                    for s, q in zip(specs, queued, strict=True)
                ]
                for q in queued:  # every request accepted before the signal
                    await asyncio.wait_for(q.wait(), 30)
                daemon.signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        outcomes = run(go())
        assert daemon.wait(30) == 0
        for spec, out in zip(specs, outcomes, strict=True):
            assert out.finished is not None, (spec.req_id, out.code, out.details)
            if out.finished.reason == ABORT:
                assert "shutting down" in out.finished.message
            else:
                assert out.tokens == spec.expected
        assert any(o.finished.reason == LENGTH for o in outcomes)
        assert any(o.finished.reason == ABORT for o in outcomes)
    finally:
        worker.stop()
        daemon.stop()


def _write_grace_config(grace: float) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(f"grace_period_s = {grace}\n")
    return f.name


def test_reflection_lists_the_three_services(one_worker: str) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(one_worker) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {
        "kvsched.v1.RequestService",
        "kvsched.v1.WorkerService",
        "kvsched.v1.AdminService",
        "grpc.health.v1.Health",
    } <= services


def test_tp2_instance_serves_and_both_ranks_see_identical_tasks() -> None:
    daemon, address = start_daemon()
    ranks = [
        start_worker(address, "tp", "--world-size", "2", "--rank", str(r), "--zero-cost")
        for r in (0, 1)
    ]
    try:
        wait_ready(address, ["tp"])
        specs = mixed_specs(60, seed=3)

        async def go() -> list[Outcome]:
            async with grpc.aio.insecure_channel(address) as ch:
                stub = request_service_pb2_grpc.RequestServiceStub(ch)
                return await asyncio.gather(*(generate(stub, s.message()) for s in specs))

        check_outcomes(specs, run(go()))
        st = wait_pool_free(address)
        assert st.instances[0].num_ranks_connected == 2 and st.instances[0].world_size == 2
    finally:
        # The daemon first: it ends both streams after everything it queued for them (the
        # answer to the last report included), so both ranks have seen the same messages.
        daemon.stop()
        for r in ranks:
            r.stop()
    digests = [r.wait_for(r"(\d+) tasks messages, tasks digest (\w+)").groups() for r in ranks]
    assert int(digests[0][0]) > 0 and digests[0] == digests[1], digests
