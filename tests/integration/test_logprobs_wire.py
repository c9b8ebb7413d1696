"""Log-probabilities on the wire (issue 35): a worker's StepReport rows reach the client with
their tokens, in Generate's Tokens and a Session's TokenDeltas, the prompt's once; a request
that did not ask gets none; a token the daemon drops (past max_tokens) takes its row with it;
a request asking of a model whose workers report none (the sim's Hello.max_logprobs is 0), or
more than they report, is refused INVALID_ARGUMENT naming the field.

The reporting worker is written by hand on a raw Connect stream (`RawWorker`, announcing
max_logprobs 5), so the test decides every row it reports; the sim worker serves another model.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvsched.client import SessionBatch, logprob_rows
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import run
from tests.integration.harness import start_daemon, start_worker, wait_ready
from tests.integration.rawworker import RawWorker, hello

MODEL = "lp-model"  # the raw worker's: reports log-probabilities
SIM_MODEL = "sim-model"  # the sim worker's: reports none


@pytest.fixture(scope="module")
def daemon():
    proc, address = start_daemon(env={"KVSCHED_HEARTBEAT_TIMEOUT_S": "60"})
    sim = start_worker(address, "sim", "--zero-cost", "--served-model-name", SIM_MODEL)
    try:
        wait_ready(address, ["sim"])
        yield address
    finally:
        sim.stop()
        proc.stop()


def _rows(*rows: tuple[float, int, list[int], list[float]]) -> common_pb2.TokenLogprobs:
    out = common_pb2.TokenLogprobs()
    for lp, rank, ids, lps in rows:
        out.logprobs.append(lp)
        out.ranks.append(rank)
        out.num_top.append(len(ids))
        out.top_token_ids.extend(ids)
        out.top_logprobs.extend(lps)
    return out


def _request(rid: str, **sampling: Any) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[7, 8, 9],
        model=MODEL,
        sampling=common_pb2.SamplingParams(ignore_eos=True, **sampling),
    )


ROW_A = (-0.5, 2, [500, 501], [-0.25, -0.5])
ROW_B = (-0.125, 1, [502, 7], [-0.125, -3.0])
ROW_C = (-1.0, 3, [1, 2], [-0.5, -0.75])
PROMPT_ROWS = ((-2.0, 4, [1], [-0.5]), (-0.75, 1, [9], [-0.75]))


def test_rows_reach_generate_with_their_tokens_and_only_for_who_asked(daemon: str) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            w = RawWorker(ch, hello("lp", model=MODEL, max_logprobs=5))
            await w.read("welcome")
            asked = stub.Generate(_request("asks", max_tokens=3, logprobs=2, prompt_logprobs=1))
            plain = stub.Generate(_request("plain", max_tokens=3))
            for call in (asked, plain):
                assert (await call.read()).queued.instance == "lp"
            placed: dict[str, Any] = {}
            while len(placed) < 2:
                t = await w.tasks_where(lambda t: len(t.placements) > 0)
                placed.update({p.request_id: p for p in t.placements})
            a, p = placed["asks"], placed["plain"]
            assert a.sampling.logprobs == 2 and a.sampling.prompt_logprobs == 1
            assert not p.sampling.HasField("logprobs")
            # step 1: both prompts and first tokens; rows for the one that asked
            w.report(
                handles=[a.handle, p.handle],
                num_computed=[3, 3],
                num_new_tokens=[1, 1],
                token_ids=[501, 601],
                num_logprobs=[1, 0],
                logprobs=_rows(ROW_A),
                prompt_logprob_handles=[a.handle],
                num_prompt_logprobs=[2],
                prompt_logprobs=_rows(*PROMPT_ROWS),
            )
            got = (await asked.read()).tokens
            assert list(got.token_ids) == [501]
            assert logprob_rows(got.logprobs) == [tuple(ROW_A)]
            assert logprob_rows(got.prompt_logprobs) == [tuple(r) for r in PROMPT_ROWS]
            got = (await plain.read()).tokens
            assert list(got.token_ids) == [601]
            assert not got.HasField("logprobs") and not got.HasField("prompt_logprobs")
            # step 2: three tokens for a request with room for two: the third and its row go
            w.report(
                handles=[a.handle],
                num_computed=[6],
                num_new_tokens=[3],
                token_ids=[502, 503, 504],
                num_logprobs=[3],
                logprobs=_rows(ROW_B, ROW_C, ROW_A),
            )
            got = (await asked.read()).tokens
            assert list(got.token_ids) == [502, 503]
            assert logprob_rows(got.logprobs) == [tuple(ROW_B), tuple(ROW_C)]
            assert not got.HasField("prompt_logprobs")  # the prompt's rows came once
            assert (await asked.read()).finished.usage.output_tokens == 3
            plain.cancel()
            w.close()

    run(go())


def test_rows_reach_a_session_with_their_tokens(daemon: str) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            w = RawWorker(ch, hello("lp-s", model="lp-session", max_logprobs=5))
            await w.read("welcome")
            session = stub.Session()
            for rid, sampling in (("s-asks", {"logprobs": 1, "prompt_logprobs": 0}), ("s-no", {})):
                msg = _request(rid, max_tokens=2, **sampling)
                msg.model = "lp-session"
                submit = rpb.SessionRequest.Submit(request=msg, client_tag=rid)
                await session.write(rpb.SessionRequest(submit=submit))
            placed: dict[str, Any] = {}
            while len(placed) < 2:
                t = await w.tasks_where(lambda t: len(t.placements) > 0)
                placed.update({p.request_id: p for p in t.placements})
            a, p = placed["s-asks"], placed["s-no"]
            w.report(
                handles=[p.handle, a.handle],
                num_computed=[3, 3],
                num_new_tokens=[1, 1],
                token_ids=[601, 501],
                num_logprobs=[0, 1],
                logprobs=_rows(ROW_A),
                prompt_logprob_handles=[a.handle],
                num_prompt_logprobs=[2],
                prompt_logprobs=_rows(*PROMPT_ROWS),
            )
            got: dict[str, list[int]] = {}
            rows: dict[str, Any] = {}
            while len(got) < 2:  # (through kvsched.client's SessionBatch)
                batch = SessionBatch(await session.read())
                got.update(batch.tokens)
                rows.update(batch.logprobs)
            assert got == {"s-asks": [501], "s-no": [601]}
            assert rows == {"s-asks": ([tuple(ROW_A)], [tuple(r) for r in PROMPT_ROWS])}
            session.cancel()
            w.close()

    run(go())


@pytest.mark.parametrize(
    ("model", "sampling", "says"),
    [
        (SIM_MODEL, {"logprobs": 1}, "logprobs: the workers of model 'sim-model' do not report"),
        (SIM_MODEL, {"prompt_logprobs": 0}, "prompt_logprobs: the workers of model 'sim-model'"),
        (SIM_MODEL, {"logprobs": -1}, "logprobs = -1 must be >= 0"),
    ],
)
def test_refused_by_name_when_the_workers_report_none(
    daemon: str, model: str, sampling: dict[str, Any], says: str
) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            msg = _request("refused", max_tokens=2, **sampling)
            msg.model = model
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(msg).read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in (err.value.details() or ""), err.value.details()

    run(go())


def test_more_alternatives_than_the_workers_report_is_refused(daemon: str) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            w = RawWorker(ch, hello("lp-max", model="lp-max-model", max_logprobs=5))
            await w.read("welcome")
            msg = _request("too-many", max_tokens=2, logprobs=6)
            msg.model = "lp-max-model"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(msg).read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "logprobs = 6 exceeds max_logprobs 5" in (err.value.details() or "")
            w.close()

    run(go())


def test_a_resumed_stream_gets_the_rows_of_the_tokens_it_lacks(daemon: str) -> None:
    """Resume from the tokens held: the rest of the tokens with their rows; the prompt's rows
    only for a Resume from the start (none here: the client holds a token)."""

    async def go() -> None:
        async with grpc.aio.insecure_channel(daemon) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            w = RawWorker(ch, hello("lp-r", model="lp-resume", max_logprobs=5))
            await w.read("welcome")
            msg = _request("r-asks", max_tokens=3, logprobs=2, prompt_logprobs=1)
            msg.model, msg.detachable = "lp-resume", True
            first = stub.Generate(msg)
            assert (await first.read()).queued.instance == "lp-r"
            (p,) = (await w.tasks_where(lambda t: len(t.placements) > 0)).placements
            w.report(
                handles=[p.handle],
                num_computed=[3],
                num_new_tokens=[1],
                token_ids=[501],
                num_logprobs=[1],
                logprobs=_rows(ROW_A),
                prompt_logprob_handles=[p.handle],
                num_prompt_logprobs=[2],
                prompt_logprobs=_rows(*PROMPT_ROWS),
            )
            assert list((await first.read()).tokens.token_ids) == [501]
            first.cancel()  # detachable: the request runs on
            resumed = stub.Resume(
                rpb.RequestServiceResumeRequest(request_id="r-asks", token_ids=[501])
            )
            assert (await resumed.read()).queued.request_id == "r-asks"
            w.report(
                handles=[p.handle],
                num_computed=[5],
                num_new_tokens=[2],
                token_ids=[502, 503],
                num_logprobs=[2],
                logprobs=_rows(ROW_B, ROW_C),
            )
            got = (await resumed.read()).tokens
            assert list(got.token_ids) == [502, 503]
            assert logprob_rows(got.logprobs) == [tuple(ROW_B), tuple(ROW_C)]
            assert not got.HasField("prompt_logprobs")
            assert (await resumed.read()).finished.usage.output_tokens == 3
            w.close()

    run(go())
