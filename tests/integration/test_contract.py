"""The daemon does what protos/kvsched/v1/*.proto say, at the points a worker author found it did
not (issue 17): pause queues new requests, TP ranks must agree, the daemon sends heartbeats,
a preempted request counts as running until acknowledged and is placed again with
last_token_id -1, Tasks.seq counts 1, 2, 3, ..., a Drain of every instance shows as draining,
and a merged report reaches the client as one Tokens message.

Most workers here are written by hand on a raw Connect stream (`RawWorker`), so the test
decides every message and sees every one the daemon sends; the reference worker serves the
rest. Daemon heartbeats come every 0.2 s here, and the heartbeat timeout is long enough that a
raw worker need not send any.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
import pytest

from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import (
    admin_service_pb2_grpc,
    common_pb2,
    request_service_pb2_grpc,
)
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import Spec, generate, run
from tests.integration.harness import start_daemon, start_worker, status, wait_ready
from tests.integration.rawworker import RawWorker, hello, read_all

LENGTH = common_pb2.FINISH_REASON_LENGTH
HEARTBEAT_S = 0.2
FAST_HEARTBEATS = {
    "KVSCHED_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
    "KVSCHED_HEARTBEAT_TIMEOUT_S": "60",
}


@pytest.fixture(scope="module")
def daemon():
    proc, address = start_daemon(env=FAST_HEARTBEATS)
    ref = start_worker(address, "ref", "--zero-cost")
    try:
        wait_ready(address, ["ref"])
        yield address
    finally:
        ref.stop()
        proc.stop()


@contextlib.asynccontextmanager
async def without_ref(admin: Any):
    """The reference worker's instance drains meanwhile: new requests go to the raw one."""
    await admin.Drain(apb.DrainRequest(instance_id="ref"), timeout=5)
    try:
        yield
    finally:
        await admin.Resume(apb.ResumeRequest(instance_id="ref"), timeout=5)


def stubs(ch: grpc.aio.Channel) -> tuple[Any, Any]:
    return (
        request_service_pb2_grpc.RequestServiceStub(ch),
        admin_service_pb2_grpc.AdminServiceStub(ch),
    )


# ---- 1. Pause: new requests queue, and are admitted after Resume -----------------------------


def test_pause_queues_new_requests_until_resume(daemon: str) -> None:
    spec = Spec("while-paused", list(range(100, 140)), 8)
    tagged = Spec("while-paused-session", list(range(200, 230)), 5)

    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            req, admin = stubs(ch)
            await admin.Pause(apb.PauseRequest(), timeout=5)
            try:
                queued = asyncio.Event()
                gen = asyncio.ensure_future(generate(req, spec.message(), queued=queued))
                await asyncio.wait_for(queued.wait(), 10)  # accepted, not UNAVAILABLE

                async def one_submit():
                    yield rpb.SessionRequest(
                        submit=rpb.SessionRequest.Submit(request=tagged.message(), client_tag="t")
                    )

                session = req.Session(one_submit())
                first = await asyncio.wait_for(session.read(), 10)
                assert not first.errors, first.errors
                assert list(first.accepted.client_tags) == ["t"]
                st = await admin.GetStatus(apb.GetStatusRequest(instance_id="ref"), timeout=5)
                assert st.paused and st.num_waiting == 2 and st.num_running == 0, st
                assert not gen.done()
            finally:
                await admin.Resume(apb.ResumeRequest(), timeout=5)
            out = await asyncio.wait_for(gen, 20)
            assert out.code is None and out.tokens == spec.expected, out
            tokens: list[int] = []
            while (m := await session.read()) is not grpc.aio.EOF:
                tokens.extend(m.tokens.token_ids)
            assert tokens == tagged.expected

    run(go())


# ---- 2. TP ranks must agree on their hello ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "mine", "theirs"),
    [("num_gpu_blocks", 64, 48), ("model", "model-a", "model-b"), ("num_slots", 8, 4)],
)
def test_tp_rank_that_disagrees_is_refused(daemon: str, field: str, mine: Any, theirs: Any) -> None:
    instance = f"tp-{field}"

    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            rank0 = RawWorker(ch, hello(instance, 0, 2, **{field: mine}))
            await rank0.read("welcome")
            rank1 = RawWorker(ch, hello(instance, 1, 2, **{field: theirs}))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rank1.read("welcome")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
            details = err.value.details() or ""
            # Names the field and both values: "rank 1 says F = X, rank 0 says Y: ..."
            assert f"{field} = {theirs!r}" in details and f"rank 0 says {mine!r}" in details
            (st,) = (
                await stubs(ch)[1].GetStatus(apb.GetStatusRequest(instance_id=instance))
            ).instances
            assert not st.ready and st.num_ranks_connected == 1
            rank0.close()

    run(go())


# ---- 3. The daemon sends heartbeats on a stream it has nothing else for ----------------------


def test_daemon_heartbeats_an_idle_worker(daemon: str) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            w = RawWorker(ch, hello("idle"))
            welcome = await w.read("welcome")
            assert welcome.heartbeat_interval_ns == int(HEARTBEAT_S * 1e9)
            for _ in range(3):  # 3 in a row: nothing else is sent to an idle instance
                beat = await w.read("heartbeat", timeout=30 * HEARTBEAT_S)
                assert beat.time_ns > 0
            assert w.seqs == []
            w.close()

    run(go())
    # The reference worker takes them in its stride: still connected, still serving.
    spec = Spec("after-heartbeats", [5, 6, 7], 4)

    async def still_serving() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            out = await generate(stubs(ch)[0], spec.message(), timeout=20)
            assert out.instance == "ref" and out.tokens == spec.expected, out

    run(still_serving())


# ---- 4, 6, 7. Pause with a worker that acknowledges late ---------------------------------------


def test_preempt_awaiting_ack_counts_as_running_and_replaces_without_last_token(
    daemon: str,
) -> None:
    """A raw worker runs one request, is paused, reports one more token before it acknowledges
    the preempt (the request counts as running until then, and that token streams), then is
    resumed: the placement that recomputes it carries last_token_id -1. Every Tasks.seq on the
    stream is 1, 2, 3, ... in order."""
    instance, prompt = "late-ack", list(range(300, 320))  # 20 tokens: one full block of 16

    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            req, admin = stubs(ch)
            w = RawWorker(ch, hello(instance))
            await w.read("welcome")

            async def instance_status() -> apb.InstanceStatus:
                st = await admin.GetStatus(apb.GetStatusRequest(instance_id=instance))
                return st.instances[0]

            msg = rpb.GenerateRequest(
                request_id="late-ack-1",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            async with without_ref(admin):
                call = req.Generate(msg)
                assert (await call.read()).queued.instance == instance
            t = await w.tasks_where(lambda t: len(t.placements) == 1)
            (p,) = t.placements
            assert (p.num_cached_tokens, p.num_prefill_tokens, p.last_token_id) == (0, 20, -1)
            assert list(t.chunks.token_ids) == prompt
            w.report(handles=[p.handle], num_computed=[20], num_new_tokens=[1], token_ids=[901])
            assert list((await call.read()).tokens.token_ids) == [901]

            await admin.Pause(apb.PauseRequest(instance_id=instance), timeout=5)
            await w.tasks_where(lambda t: list(t.preempts) == [p.handle])
            # Preempted, not acknowledged: the worker may still be running it.
            st = await instance_status()
            assert (st.num_running, st.num_waiting) == (1, 0), st
            top = await admin.GetStatus(apb.GetStatusRequest())
            assert top.num_running >= 1
            w.report(handles=[p.handle], num_computed=[21], num_new_tokens=[1], token_ids=[902])
            assert list((await call.read()).tokens.token_ids) == [902]
            w.report(acked=[p.handle])
            for _ in range(100):  # the ack is applied on the daemon's next wake
                st = await instance_status()
                if st.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            assert (st.num_running, st.num_waiting) == (0, 1), st

            await admin.Resume(apb.ResumeRequest(instance_id=instance), timeout=5)
            t = await w.tasks_where(lambda t: len(t.placements) == 1)
            (q,) = t.placements
            assert q.handle > p.handle and q.num_output_tokens == 2
            assert q.num_prefill_tokens == 22 and q.num_cached_tokens < 22
            assert q.last_token_id == -1, "prefill remains: the worker must not start decoding"
            assert list(t.chunks.token_ids) == [*prompt, 901, 902][q.num_cached_tokens :]
            w.report(
                handles=[q.handle],
                num_computed=[22],
                num_new_tokens=[1],
                token_ids=[903],
                finish_reasons=[LENGTH],
            )
            rest = await read_all(call)
            assert [tok for r in rest for tok in r.tokens.token_ids] == [903]
            assert rest[-1].finished.reason == LENGTH
            assert rest[-1].finished.usage.output_tokens == 3
            await w.read("tasks")  # the answer to the last report
            assert w.seqs == list(range(1, len(w.seqs) + 1)), w.seqs
            w.close()

    run(go())


# ---- 8. A merged report reaches a Generate stream as one Tokens message ----------------------


def test_merged_report_is_one_tokens_message(daemon: str) -> None:
    """Two steps merged into one StepReport (the request's row once per step): the client gets
    both steps' tokens in one Tokens message, as request_service.proto says it may."""
    instance = "merging"

    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            req, admin = stubs(ch)
            w = RawWorker(ch, hello(instance))
            await w.read("welcome")
            msg = rpb.GenerateRequest(
                request_id="merged-1",
                prompt_token_ids=[7, 8, 9],
                sampling=common_pb2.SamplingParams(max_tokens=10, ignore_eos=True),
            )
            async with without_ref(admin):
                call = req.Generate(msg)
                assert (await call.read()).queued.instance == instance
            (p,) = (await w.tasks_where(lambda t: len(t.placements) == 1)).placements
            w.step += 1  # steps 1 and 2 go out merged: the report carries the last one
            w.report(
                handles=[p.handle, p.handle],
                num_computed=[3, 4],
                num_new_tokens=[1, 1],
                token_ids=[501, 502],
            )
            assert list((await call.read()).tokens.token_ids) == [501, 502]
            call.cancel()
            w.close()

    run(go())


# ---- GetStatusResponse.draining after a Drain of every instance -----------------------------


def test_drain_of_every_instance_shows_as_draining(daemon: str) -> None:
    with grpc.insecure_channel(daemon) as ch:
        admin = admin_service_pb2_grpc.AdminServiceStub(ch)
        requests = request_service_pb2_grpc.RequestServiceStub(ch)
        admin.Drain(apb.DrainRequest(), timeout=5)
        try:
            assert status(daemon).draining
            with pytest.raises(grpc.RpcError) as err:
                list(requests.Generate(Spec("drained", [1, 2], 2).message(), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            admin.Resume(apb.ResumeRequest(), timeout=5)
        assert not status(daemon).draining


# ---- 5. usage.cached_tokens: the instance that finished the request --------------------------


def test_cached_tokens_of_a_moved_request_are_those_of_the_instance_that_finished_it() -> None:
    """A request placed with a prefix hit on instance a, whose worker is killed mid-decode,
    finishes on instance b, which had nothing cached: usage.cached_tokens is b's hit (0), not
    the hit a lost with it."""
    prefix = list(range(1000, 1256))  # 16 full blocks
    proc, address = start_daemon()
    a = start_worker(address, "a", "--speed", "0.1")  # ~60 ms a step: still decoding when killed
    b = None
    try:
        wait_ready(address, ["a"])
        warm = Spec("warm", [*prefix, 1], 1)
        moved = Spec("moved", [*prefix, 2, 3], 100)

        async def go() -> None:
            nonlocal b
            async with grpc.aio.insecure_channel(address) as ch:
                req, _ = stubs(ch)
                out = await generate(req, warm.message(), timeout=30)
                assert out.finished is not None and out.finished.usage.cached_tokens == 0, out
                b = start_worker(address, "b", "--zero-cost")
                await asyncio.to_thread(wait_ready, address, ["b"])
                call = req.Generate(moved.message())
                queued = (await call.read()).queued
                assert queued.instance == "a"  # where the prefix is cached
                tokens = list((await call.read()).tokens.token_ids)
                a.signal(9)  # kill -9 mid-decode
                fin = None
                for r in await read_all(call):
                    if r.WhichOneof("kind") == "tokens":
                        tokens.extend(r.tokens.token_ids)
                    else:
                        fin = r.finished
                assert tokens == moved.expected
                assert fin is not None and fin.reason == LENGTH, fin
                assert fin.usage.cached_tokens == 0, fin.usage

        run(go())
        assert status(address, "b").instances[0].num_steps > 0  # it did finish there
    finally:
        for w in (a, b):
            if w is not None:
                w.stop()
        proc.stop()


# ---- found by the C++ worker: silence is UNAVAILABLE, stale reports are dropped -------------


def test_a_silent_worker_is_told_unavailable_so_it_reconnects() -> None:
    """worker_service.proto: a rank silent past heartbeat_timeout_s is treated as if it had
    disconnected. Its stream ends with UNAVAILABLE (reconnect), not FAILED_PRECONDITION (which
    workers take as final: a worker stalled by SIGSTOP or a long pause would leave for good)."""
    proc, address = start_daemon(
        env={"KVSCHED_HEARTBEAT_INTERVAL_S": "0.1", "KVSCHED_HEARTBEAT_TIMEOUT_S": "0.5"}
    )

    async def go() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as ch:
            w = RawWorker(ch, hello("quiet"))
            await w.read("welcome")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:  # heartbeats and tasks, until the daemon gives up on the silence
                    await w.read("never", timeout=10)
            return err.value.code()

    try:
        assert run(go()) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.stop()


def test_reports_a_taken_out_stream_still_sends_are_dropped() -> None:
    """An instance taken out while its rank 0 still reports: what that stream sends afterwards
    must not reach the engine, or the instance's NEXT scheduler applies a report about tasks it
    never sent and is taken out again (FAILED_PRECONDITION, its requests end with ERROR)."""
    from kvsched.daemon.app import Daemon
    from kvsched.server.config.load import load_config
    from kvsched.server.instances.workers import WorkerServicer
    from kvsched.v1 import worker_service_pb2 as wpb

    async def go() -> tuple[int, int]:
        config = load_config(None, {}, {"listen": "127.0.0.1:0", "metrics_listen": ""})
        daemon = Daemon(config)
        eng, conn = daemon.registry.attach_worker(hello("i0"))
        eng.take_out("test: rank 1 lost")
        assert conn.closed
        stale = wpb.ConnectRequest(report=wpb.StepReport(step=1, applied_seq=157))

        async def stream() -> Any:
            yield stale

        await WorkerServicer(daemon.registry)._read(stream(), eng, conn)
        pending_after_take_out = len(eng.reports)
        _, conn2 = daemon.registry.attach_worker(hello("i0"))  # the instance comes back
        await WorkerServicer(daemon.registry)._read(stream(), eng, conn2)
        return pending_after_take_out, len(eng.reports)

    dropped, live = run(go())
    assert dropped == 0, "a report read after take_out was queued for the next scheduler"
    assert live == 1, "the new stream's report must still reach the engine"


def test_an_unset_max_tokens_takes_the_daemons_configured_default() -> None:
    """common.proto: an absent SamplingParams.max_tokens is the daemon's default_max_tokens
    (16 unless configured); an explicit one wins."""
    proc, address = start_daemon(env={"KVSCHED_DEFAULT_MAX_TOKENS": "5"})
    worker = start_worker(address, "w", "--zero-cost")

    async def go() -> tuple[Any, Any]:
        async with grpc.aio.insecure_channel(address) as ch:
            stub, _ = stubs(ch)
            unset = rpb.GenerateRequest(
                request_id="unset",
                prompt_token_ids=[1, 2, 3, 4],
                sampling=common_pb2.SamplingParams(ignore_eos=True),
            )
            explicit = rpb.GenerateRequest(
                request_id="explicit",
                prompt_token_ids=[1, 2, 3, 4],
                sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
            )
            return await asyncio.gather(
                generate(stub, unset, timeout=30), generate(stub, explicit, timeout=30)
            )

    try:
        wait_ready(address, ["w"])
        unset, explicit = run(go())
    finally:
        worker.stop()
        proc.stop()
    assert unset.finished is not None and unset.finished.reason == LENGTH
    assert len(unset.tokens) == 5 and unset.finished.usage.output_tokens == 5
    assert explicit.finished is not None and len(explicit.tokens) == 3
