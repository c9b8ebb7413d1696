"""Several submits in one Session message (SessionRequest.batch), against a real daemon and sim
worker on loopback: the daemon announces it as the stream opens; each submit of a batch is
answered as a single submit would be (accepted with its own id, or refused by its client tag
while the others run), an empty batch is refused in band, max_session_requests counts each
submit of a batch; `AsyncSession.submit_many_built` sends one message for a burst."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from kvsched.client import AsyncClient
from kvsched.client import batch as batching
from kvsched.client.types import build_request, build_submit
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.integration.clients import expected_tokens
from tests.integration.harness import start_daemon, start_worker, wait_ready
from tests.integration.test_overload import config

LIMIT = 5  # the daemon's max_session_requests
PROMPT = [5, 6, 7, 8, 9, 10]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    daemon, addr = start_daemon("--config", config(f"max_session_requests = {LIMIT}\n"))
    worker = start_worker(addr, "i0")
    try:
        wait_ready(addr, ["i0"])
        yield addr
    finally:
        worker.stop()
        daemon.stop()


def _submit(rid: str, max_tokens: int, prompt: list[int] = PROMPT) -> rpb.SessionRequest.Submit:
    req = build_request(prompt, {"request_id": rid, "max_tokens": max_tokens, "ignore_eos": True})
    return rpb.SessionRequest.Submit(request=req, client_tag=f"tag-{rid}")


def _batch(*submits: rpb.SessionRequest.Submit) -> rpb.SessionRequest:
    return rpb.SessionRequest(batch=rpb.SessionRequest.SubmitBatch(submits=submits))


def _session(address: str, msgs: list[rpb.SessionRequest]) -> list[rpb.SessionResponse]:
    """Send `msgs` on one Session (raw stub, no client library), half-close, read it all."""
    with grpc.insecure_channel(address) as channel:
        stub = request_service_pb2_grpc.RequestServiceStub(channel)  # type: ignore[no-untyped-call]
        return list(stub.Session(iter(msgs), timeout=60))


def _tokens(out: list[rpb.SessionResponse]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for m in out:
        pos = 0
        for rid, n in zip(m.tokens.request_ids, m.tokens.num_tokens, strict=True):
            got.setdefault(rid, []).extend(m.tokens.token_ids[pos : pos + n])
            pos += n
    return got


def test_a_batch_is_accepted_submit_by_submit_and_each_request_gets_its_tokens(
    address: str,
) -> None:
    ids = [f"b{i}" for i in range(LIMIT)]
    out = _session(address, [_batch(*(_submit(rid, 3 + i) for i, rid in enumerate(ids)))])
    # Read at once: every acceptance in the first answer, in the batch's order, with its tag.
    acc = out[0].accepted
    assert list(acc.request_ids) == ids
    assert list(acc.client_tags) == [f"tag-{rid}" for rid in ids]
    assert list(acc.instances) == ["i0"] * LIMIT
    assert not [e for m in out for e in m.errors]
    finished = {f.request_id: f.reason for m in out for f in m.finished}
    assert finished == dict.fromkeys(ids, common_pb2.FINISH_REASON_LENGTH)
    want = {rid: expected_tokens(rid, len(PROMPT), 3 + i, []) for i, rid in enumerate(ids)}
    assert _tokens(out) == want


def test_one_bad_submit_in_a_batch_is_refused_alone_and_the_others_run(address: str) -> None:
    bad = _submit("x1", 3, prompt=[5, 6, 10**9])  # a token id outside the vocabulary
    out = _session(address, [_batch(_submit("x0", 4), bad, _submit("x2", 5))])
    errors = [e for m in out for e in m.errors]
    assert [(e.client_tag, e.request_id, e.code) for e in errors] == [("tag-x1", "x1", INVALID)]
    assert "vocab" in errors[0].message
    assert [rid for m in out for rid in m.accepted.request_ids] == ["x0", "x2"]
    assert _tokens(out) == {
        "x0": expected_tokens("x0", len(PROMPT), 4, []),
        "x2": expected_tokens("x2", len(PROMPT), 5, []),
    }
    assert sorted(f.request_id for m in out for f in m.finished) == ["x0", "x2"]


def test_an_empty_batch_is_refused_in_band_and_the_session_goes_on(address: str) -> None:
    out = _session(address, [_batch(), rpb.SessionRequest(submit=_submit("e0", 3))])
    errors = [e for m in out for e in m.errors]
    assert [(e.client_tag, e.request_id, e.code) for e in errors] == [("", "", INVALID)]
    assert "batch holds no submit" in errors[0].message
    assert _tokens(out) == {"e0": expected_tokens("e0", len(PROMPT), 3, [])}


def test_max_session_requests_counts_each_submit_of_a_batch(address: str) -> None:
    # LIMIT + 2 long requests in one batch: the first LIMIT are accepted, the last two refused
    # by the session's limit (each by its tag); the accepted ones are then aborted.
    ids = [f"m{i}" for i in range(LIMIT + 2)]

    async def main() -> tuple[list[str], list[tuple[str, int]], dict[str, str]]:
        accepted: list[str] = []
        errors: list[tuple[str, int]] = []
        finished: dict[str, str] = {}
        async with AsyncClient(address, timeout=60) as client, client.session() as session:
            assert await session.header_read(10.0) > 0
            opts = {"max_tokens": 100_000, "ignore_eos": True}
            msgs = [build_submit(PROMPT, {**opts, "request_id": r}, r) for r in ids]  # type: ignore[arg-type]
            assert await session.submit_many_built(msgs) == ids
            assert (session.batches_sent, session.batched_submits) == (1, LIMIT + 2)
            async for batch in session:
                for a in batch.accepted:
                    accepted.append(a.request_id)
                    await session.abort(a.request_id)
                errors.extend((e.client_tag, e.exception().code.value[0]) for e in batch.errors)
                finished.update((f.request_id, f.reason) for f in batch.finished)
                if len(finished) == LIMIT and len(errors) == 2:
                    break
        return accepted, errors, finished

    accepted, errors, finished = asyncio.run(main())
    assert accepted == ids[:LIMIT]
    assert errors == [(ids[LIMIT], EXHAUSTED), (ids[LIMIT + 1], EXHAUSTED)]
    assert finished == dict.fromkeys(ids[:LIMIT], "abort")


def test_submit_many_built_sends_a_burst_in_one_message_each_answered_alone(
    address: str,
) -> None:
    ids = [f"s{i}" for i in range(4)]

    async def main() -> tuple[dict[str, list[int]], list[list[str]], tuple[int, int]]:
        tokens: dict[str, list[int]] = {}
        accepted: list[list[str]] = []
        async with AsyncClient(address, timeout=60) as client, client.session() as session:
            assert await session.header_read(10.0) > 0
            msgs = [
                build_submit(PROMPT, {"request_id": r, "max_tokens": 4, "ignore_eos": True}, r)
                for r in ids
            ]
            await session.submit_many_built(msgs)
            await session.submit_many_built([])  # nothing to send: no message
            await session.close()
            async for batch in session:
                if batch.accepted:
                    accepted.append([a.request_id for a in batch.accepted])
                for rid, new in batch.tokens.items():
                    tokens.setdefault(rid, []).extend(new)
            return tokens, accepted, (session.batches_sent, session.batched_submits)

    tokens, accepted, counts = asyncio.run(main())
    assert counts == (1, 4)
    assert accepted == [ids]  # one message in: all four accepted in the first answer
    assert tokens == {r: expected_tokens(r, len(PROMPT), 4, []) for r in ids}


def test_a_burst_over_part_bytes_goes_in_several_batches_all_answered(address: str) -> None:
    # 4 prompts of ~120 KB each (40k ids of 3 bytes): two batches of two (batch.PART_BYTES),
    # every submit accepted; the session is then dropped (its requests aborted).
    prompt = [1 + i % 31_000 for i in range(40_000)]
    ids = [f"p{i}" for i in range(4)]

    async def main() -> tuple[list[str], tuple[int, int]]:
        accepted: list[str] = []
        async with AsyncClient(address, timeout=60) as client:
            session = client.session()
            assert await session.header_read(10.0) > 0
            opts = {"max_tokens": 1, "ignore_eos": True}
            msgs = [build_submit(prompt, {**opts, "request_id": r}, r) for r in ids]  # type: ignore[arg-type]
            assert 2 * msgs[0].ByteSize() < batching.PART_BYTES < 3 * msgs[0].ByteSize()
            await session.submit_many_built(msgs)
            async for batch in session:
                accepted.extend(a.request_id for a in batch.accepted)
                assert not batch.errors, [e.exception() for e in batch.errors]
                if len(accepted) == len(ids):
                    break
            session.cancel()
            return accepted, (session.batches_sent, session.batched_submits)

    accepted, counts = asyncio.run(asyncio.wait_for(main(), 60))
    assert accepted == ids
    assert counts == (2, 4)
