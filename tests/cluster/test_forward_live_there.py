"""A forward that finds its request already live on the peer (issue 23, the one error of the
25-minute nemesis run): real daemons on a real nats-server, a sim worker, loopback.

In the run a forwarder's Generate to a peer broke after the peer had accepted the request; the
forwarder sent it again, the peer answered INVALID_ARGUMENT "request_id ... is already in use by
a live request" and the forwarder ended the client's request with that error. Here the earlier
forward is made by hand (a Generate to `lv-b` carrying `lv-a`'s forwarding metadata, detachable
like the resumable clients' requests, its stream dropped after a few tokens), so the request is
live on `lv-b` when `lv-a`'s forward of it arrives, every time. `lv-a` has no instance: it
forwards to `lv-b`'s, the only one.

- The same request (same id, same prompt): `lv-a` follows it on `lv-b` by Resume; its client
  gets every token once, exactly the sim's, and one Finished.
- The id reused with another prompt: still INVALID_ARGUMENT (the peer's refusal carries no
  "same request" marker, so nothing follows it), and the request live on `lv-b` goes on
  untouched: a Resume there gets all of its own tokens.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvsched.client import AlreadyLive, AsyncClient, InvalidArgument
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS, resumable
from kvsched.cluster.natsd import NatsServer
from kvsched.cluster.peer_rpc import FORWARD_OWNER, FORWARDED_BY
from kvsched.core.errors import RequestAlreadyLive
from kvsched.server.errors import ERROR_TYPE_KEY
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.durability_kit import (
    Daemon,
    read_rest,
    resume_all,
    routes_to,
    sim_expected,
    start_sim_worker,
    through,
)
from tests.integration.clients import Outcome, Spec
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

MAX_TOKENS = 80  # at --speed 0.1 a few seconds of decoding: live on b through the whole test


async def _live_on(
    address: str, spec: Spec, tokens: int, md: tuple[tuple[str, str], ...] | None = None
) -> list[int]:
    """`spec` submitted to `address` as `lv-a`'s forward of it would be (detachable, the
    forwarding metadata; `md`: other metadata, e.g. none for a client's own call); its stream
    dropped once it has `tokens` tokens (the request keeps running). Returns the tokens it
    got."""
    if md is None:
        md = ((FORWARDED_BY, "lv-a"), (FORWARD_OWNER, ""))
    got: list[int] = []
    async with grpc.aio.insecure_channel(address) as ch:
        call = request_service_pb2_grpc.RequestServiceStub(ch).Generate(
            spec.message(detachable=True), metadata=md, timeout=60
        )
        async for r in call:
            assert r.WhichOneof("kind") != "finished", "finished before the forward came"
            got.extend(r.tokens.token_ids)
            if len(got) >= tokens:
                break
        call.cancel()
    return got


async def _refusal(address: str, msg: rpb.GenerateRequest) -> tuple[grpc.StatusCode, str, str]:
    """A Generate straight to `address`: its status code, details and error-type trailer."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = request_service_pb2_grpc.RequestServiceStub(ch).Generate(msg, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        trailer = dict(await call.trailing_metadata() or ())
        return err.value.code(), err.value.details() or "", str(trailer.get(ERROR_TYPE_KEY))


@pytest.fixture(scope="module")
def pair(nats_server: NatsServer) -> Iterator[tuple[Daemon, Daemon]]:
    """`lv-a` (no instance) forwarding to `lv-b`'s slow sim instance `lv0`."""
    a = Daemon(nats_server.url, "lv-a").start()
    b = Daemon(nats_server.url, "lv-b").start()
    workers: list[Proc] = []
    try:
        workers.append(start_sim_worker(b.address, "lv0", "--speed", "0.1"))
        wait_ready(b.address, ["lv0"], 60.0)
        routes_to(a.address, "lv0", "lv")
        yield a, b
    finally:
        for w in workers:
            w.stop()
        a.stop()
        b.stop()


def test_a_forward_of_a_request_live_on_the_peer_follows_it_there(
    pair: tuple[Daemon, Daemon],
) -> None:
    a, b = pair
    spec = Spec("lv-1", [11] * 40, MAX_TOKENS)

    async def scenario() -> tuple[list[int], Outcome]:
        first = await _live_on(b.address, spec, 3)
        (out,) = await through(a.address, [spec])
        return first, out

    first, out = asyncio.run(asyncio.wait_for(scenario(), 120))
    want = sim_expected("lv-1", 40, MAX_TOKENS)
    assert first == want[: len(first)]
    assert out.code is None, (out.code, out.details)
    assert out.finished is not None
    assert out.finished.reason == common_pb2.FINISH_REASON_LENGTH, out.finished.message
    assert out.tokens == want  # each token once, all of them
    assert a.proc is not None
    # It was live on b when a's forward came (not finished and sent again): followed there.
    a.proc.wait_for(r"request lv-1 is live at daemon lv-b already: following it there", 1)


def test_an_id_reused_with_another_prompt_is_still_refused(pair: tuple[Daemon, Daemon]) -> None:
    a, b = pair
    spec = Spec("lv-2", [12] * 40, MAX_TOKENS)
    other = Spec("lv-2", [13] * 41, MAX_TOKENS)

    Refusal = tuple[grpc.StatusCode, str, str]

    async def scenario() -> tuple[Refusal, Refusal, Outcome, tuple[list[int], rpb.Finished | None]]:
        await _live_on(b.address, spec, 3)
        same = await _refusal(b.address, spec.message())
        differs = await _refusal(b.address, other.message())
        (through_a,) = await through(a.address, [other])
        rest = await resume_all(b.address, "lv-2")
        return same, differs, through_a, rest

    same, differs, through_a, (tokens, fin) = asyncio.run(asyncio.wait_for(scenario(), 120))
    # Straight from a client, a duplicate is refused either way; the same request is marked.
    assert same[0] == grpc.StatusCode.INVALID_ARGUMENT, same
    assert "already in use by a live request" in same[1]
    assert same[2] == RequestAlreadyLive.__name__
    assert differs[0] == grpc.StatusCode.INVALID_ARGUMENT, differs
    assert "already in use by a live request" in differs[1]
    assert differs[2] == "InvalidRequest"
    # Forwarded with another prompt: ended with the peer's refusal, never given lv-2's tokens.
    assert through_a.tokens == [], through_a.tokens
    assert through_a.finished is not None, (through_a.code, through_a.details)
    assert through_a.finished.reason == common_pb2.FINISH_REASON_ABORT
    assert "INVALID_ARGUMENT" in through_a.finished.message
    assert "already in use by a live request" in through_a.finished.message
    # The request live on b is untouched: all of its own tokens, one Finished.
    assert tokens == sim_expected("lv-2", 40, MAX_TOKENS)
    assert fin is not None and fin.reason == common_pb2.FINISH_REASON_LENGTH, fin


def test_a_client_resuming_at_the_peer_keeps_the_stream(pair: tuple[Daemon, Daemon]) -> None:
    """The other half of the 30-minute run's one lost request: a client's Generate through
    `lv-a` (forwarded to `lv-b`, detachable) breaks after a few tokens and the client resumes
    straight at `lv-b`. `lv-b` ends `lv-a`'s relay (OK, no Finished: one request streams to
    one place); `lv-a` must not follow the request there again: that Resume would take the
    stream back from the client (whose stream would end without Finished)."""
    a, b = pair
    spec = Spec("lv-3", [14] * 40, MAX_TOKENS)

    async def scenario() -> tuple[list[int], list[int], rpb.Finished | None]:
        first = await _live_on(a.address, spec, 3, md=())
        rest, fin = await resume_all(b.address, "lv-3", first)
        return first, rest, fin

    first, rest, fin = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert fin is not None, "the client's Resume stream was taken from it (no Finished)"
    assert fin.reason == common_pb2.FINISH_REASON_LENGTH, fin.message
    assert first + rest == sim_expected("lv-3", 40, MAX_TOKENS)  # each token once, all
    assert a.proc is not None
    a.proc.wait_for(
        r"request lv-3 runs on at daemon lv-b \(a Resume there took its stream over\)", 1
    )


def test_a_forwarded_request_is_queued_only_once_the_peer_accepted_it(
    pair: tuple[Daemon, Daemon],
) -> None:
    """The 30-minute run's other lost request: `lv-a` told its client `queued` as soon as it
    had started forwarding, before `lv-b` had accepted (and journaled) the request; killed in
    between, it left a client holding `queued` for a request no journal had (Resume: NOT_FOUND).
    With `lv-b` paused, `lv-a`'s client must get no `queued` until `lv-b` answers; then every
    token once and one Finished."""
    a, b = pair
    spec = Spec("lv-4", [15] * 40, 20)
    assert b.proc is not None

    async def scenario() -> tuple[bool, list[int], rpb.Finished | None]:
        async with grpc.aio.insecure_channel(a.address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            b.proc.signal(signal.SIGSTOP)
            try:
                call = stub.Generate(spec.message(detachable=True), timeout=90)
                first = asyncio.ensure_future(call.read())
                await asyncio.wait({first}, timeout=1.5)
                early = first.done()
            finally:
                b.proc.signal(signal.SIGCONT)
            msg = await first
            assert msg.WhichOneof("kind") == "queued", msg
            tokens: list[int] = []
            fin = await read_rest(call, tokens)
            return early, tokens, fin

    early, tokens, fin = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert not early, "lv-a said queued while lv-b, paused, had not accepted the request"
    assert fin is not None and fin.reason == common_pb2.FINISH_REASON_LENGTH, fin
    assert tokens == sim_expected("lv-4", 40, 20)


def test_a_resumable_client_whose_submit_meets_its_own_live_request_follows_it(
    pair: tuple[Daemon, Daemon],
) -> None:
    """The 30-minute run's INVALID_ARGUMENT loss: an attempt the resumable client gave up on
    (no answer in time) was accepted after all, so its next Generate meets the request live
    at the daemon. The client library reads the typed marker (AlreadyLive, an InvalidArgument)
    and follows the live request by Resume instead of failing; another prompt under the same
    id is still a plain InvalidArgument."""
    _, b = pair
    spec = Spec("lv-5", [16] * 40, MAX_TOKENS)

    async def scenario() -> tuple[BaseException, BaseException, list[int], int]:
        await _live_on(b.address, spec, 3, md=())  # the attempt it gave up on
        async with AsyncClient(b.address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
            same = await _raised(
                client.generate(spec.prompt, request_id="lv-5", max_tokens=MAX_TOKENS)
            )
            other = await _raised(client.generate([17] * 41, request_id="lv-5", max_tokens=5))
            stream = resumable(
                client, spec.prompt, request_id="lv-5", max_tokens=MAX_TOKENS, ignore_eos=True
            )
            tokens = await stream.read_all()
            assert stream.finished is not None, stream.last_error
            assert stream.finished.reason == "length", stream.finished
            return same, other, tokens, stream.resumes

    same, other, tokens, resumes = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert isinstance(same, AlreadyLive), repr(same)
    assert isinstance(other, InvalidArgument) and not isinstance(other, AlreadyLive), repr(other)
    assert tokens == sim_expected("lv-5", 40, MAX_TOKENS)  # followed from its first token
    assert resumes == 1


async def _raised(aw: object) -> BaseException:
    try:
        await aw  # type: ignore[misc]
    except Exception as exc:
        return exc
    raise AssertionError("no error")


def test_a_forwarded_session_request_is_accepted_only_once_the_peer_accepted_it(
    pair: tuple[Daemon, Daemon],
) -> None:
    """The Session form of the queued-before-accepted loss: a request a Session submits at
    `lv-a` runs on `lv-b`'s instance; with `lv-b` paused, the session must say nothing about
    it (no `accepted`) until `lv-b` answers; then its tokens, each once, and one Finished."""
    a, b = pair
    spec = Spec("lv-6", [18] * 40, 20)
    assert b.proc is not None

    async def scenario() -> tuple[bool, list[str], list[int], list[rpb.Finished]]:
        async with grpc.aio.insecure_channel(a.address) as ch:
            call = request_service_pb2_grpc.RequestServiceStub(ch).Session(timeout=90)
            b.proc.signal(signal.SIGSTOP)
            try:
                await call.write(
                    rpb.SessionRequest(
                        submit=rpb.SessionRequest.Submit(
                            request=spec.message(detachable=True), client_tag="t6"
                        )
                    )
                )
                first = asyncio.ensure_future(call.read())
                await asyncio.wait({first}, timeout=1.5)
                early = first.done()
            finally:
                b.proc.signal(signal.SIGCONT)
            accepted: list[str] = []
            tokens: list[int] = []
            fins: list[rpb.Finished] = []
            msg = await first
            while msg is not grpc.aio.EOF:
                accepted.extend(msg.accepted.request_ids)
                if msg.HasField("tokens"):
                    assert accepted, "tokens before accepted"
                    tokens.extend(msg.tokens.token_ids)
                fins.extend(msg.finished)
                assert not msg.errors, msg.errors
                if fins:
                    await call.done_writing()
                msg = await call.read()
            return early, accepted, tokens, fins

    early, accepted, tokens, fins = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert not early, "lv-a told the session accepted while lv-b, paused, had not accepted it"
    assert accepted == ["lv-6"]
    assert len(fins) == 1 and fins[0].reason == common_pb2.FINISH_REASON_LENGTH, fins
    assert tokens == sim_expected("lv-6", 40, 20)


def test_a_request_is_never_followed_back_to_the_daemon_it_is_relayed_from(
    pair: tuple[Daemon, Daemon],
) -> None:
    """The 30-minute run of 592748b lost a request to a circle: d2 followed it at d1 (which
    relayed it), then d1 forwarded it to d2; each relayed the other's relay, nobody ran it, and
    the client's stream at d2 was taken by d1's Resume. Here `lv-a` relays `lv-7` from `lv-b`;
    a Generate or Resume of it that `lv-b` sends back to `lv-a` (made by hand, with `lv-b`'s
    forwarding metadata) is refused with UNAVAILABLE (place it elsewhere), and the client
    reading it at `lv-a` keeps its stream: every token once, one Finished."""
    a, _ = pair
    spec = Spec("lv-7", [19] * 40, MAX_TOKENS)
    back = ((FORWARDED_BY, "lv-b"), (FORWARD_OWNER, ""))

    async def scenario() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError, list[int], Any]:
        async with grpc.aio.insecure_channel(a.address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            call = stub.Generate(spec.message(detachable=True), timeout=90)
            tokens: list[int] = []
            while len(tokens) < 3:
                r = await call.read()
                assert r is not grpc.aio.EOF, "ended early"
                tokens.extend(r.tokens.token_ids)
            with pytest.raises(grpc.aio.AioRpcError) as gen:
                async for _ in stub.Generate(spec.message(detachable=True), metadata=back):
                    pass
            resume = rpb.RequestServiceResumeRequest(request_id="lv-7", token_ids=tokens)
            with pytest.raises(grpc.aio.AioRpcError) as res:
                async for _ in stub.Resume(resume, metadata=back, timeout=30):
                    pass
            fin = await read_rest(call, tokens)
            return gen.value, res.value, tokens, fin

    gen, res, tokens, fin = asyncio.run(asyncio.wait_for(scenario(), 120))
    for err in (gen, res):
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        assert "relayed to this daemon from daemon lv-b" in (err.details() or "")
    assert fin is not None, "the client's stream was taken from it (no Finished)"
    assert fin.reason == common_pb2.FINISH_REASON_LENGTH, fin.message
    assert tokens == sim_expected("lv-7", 40, MAX_TOKENS)
