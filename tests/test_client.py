"""kvsched.client against a real daemon and sim worker on loopback: generate (sync and async),
session submit/abort, abort, status, a typed error for each refusal, deadlines, bearer tokens
over TLS, and the docs' examples run as written."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import Iterator

import grpc
import pytest

from kvsched.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    KvschedClientError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from tests.integration.certs import CertAuthority
from tests.integration.clients import expected_tokens
from tests.integration.harness import REPO, start_daemon, start_worker, wait_pool_free, wait_ready

LONG = 100_000  # max_tokens of a request that runs until it is aborted or cut
PROMPT = [5, 6, 7, 8, 9, 10]


def want(req_id: str, prompt: list[int], n: int) -> list[int]:
    return expected_tokens(req_id, len(prompt), n, [])


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    """A daemon and one sim worker whose steps take simulated time, so that a long request is
    still running when it is aborted or its deadline passes."""
    daemon, addr = start_daemon()
    worker = start_worker(addr, "i0", "--speed", "4")
    try:
        wait_ready(addr, ["i0"])
        yield addr
    finally:
        worker.stop()
        daemon.stop()


def test_generate_sync_streams_batches_then_the_finished_record(address: str) -> None:
    with Client(address, timeout=30) as client:
        stream = client.generate(PROMPT, request_id="sync-1", max_tokens=12, ignore_eos=True)
        assert (stream.request_id, stream.instance) == ("sync-1", "i0")
        batches = list(stream)
    assert all(batches) and [t for b in batches for t in b] == want("sync-1", PROMPT, 12)
    f = stream.finished
    assert f is not None and (f.request_id, f.reason) == ("sync-1", "length")
    assert (f.usage.prompt_tokens, f.usage.output_tokens) == (len(PROMPT), 12)
    assert 0 <= f.timings.queue_s <= f.timings.ttft_s <= f.timings.e2e_s


def test_generate_async_concurrent_requests(address: str) -> None:
    async def main() -> list[tuple[list[int], str]]:
        async with AsyncClient(address, timeout=30) as client:

            async def one(i: int) -> tuple[list[int], str]:
                stream = await client.generate(
                    PROMPT, request_id=f"async-{i}", max_tokens=5 + i, ignore_eos=True
                )
                tokens = await stream.tokens()
                assert stream.finished is not None
                return tokens, stream.finished.reason

            return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(main())
    assert results == [(want(f"async-{i}", PROMPT, 5 + i), "length") for i in range(4)]


def test_session_submit_abort_and_errors(address: str) -> None:
    tokens: dict[str, list[int]] = {}
    finished = {}
    accepted = {}
    errors = []
    aborted = False
    with Client(address, timeout=60) as client, client.session() as session:
        short = session.submit(PROMPT, request_id="sess-short", max_tokens=7, ignore_eos=True)
        long = session.submit(PROMPT, request_id="sess-long", max_tokens=LONG, ignore_eos=True)
        bad = session.submit([], client_tag="empty")  # refused; the session goes on
        session.abort("sess-nope")  # unknown id: an error entry, not the end of the stream
        for batch in session:
            for a in batch.accepted:
                accepted[a.client_tag] = a.request_id
            for rid, new in batch.tokens.items():
                tokens.setdefault(rid, []).extend(new)
                if rid == "sess-long" and not aborted:
                    aborted = True
                    session.abort("sess-long")
                    session.close()  # ends once both accepted requests have finished
            finished.update({f.request_id: f for f in batch.finished})
            errors.extend(batch.errors)
    assert accepted == {short: "sess-short", long: "sess-long"}
    assert tokens["sess-short"] == want("sess-short", PROMPT, 7)
    assert finished["sess-short"].reason == "length"
    assert finished["sess-long"].reason == "abort"
    assert finished["sess-long"].usage.output_tokens == len(tokens["sess-long"]) < LONG
    by_tag = {(e.client_tag, e.request_id): e.exception() for e in errors}
    assert set(by_tag) == {(bad, ""), ("", "sess-nope")}
    assert isinstance(by_tag[(bad, "")], InvalidArgument)
    assert isinstance(by_tag[("", "sess-nope")], NotFound)
    assert by_tag[("", "sess-nope")].code == grpc.StatusCode.NOT_FOUND


def test_async_session(address: str) -> None:
    async def main() -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        async with AsyncClient(address, timeout=30) as client, client.session() as session:
            for i in range(3):
                await session.submit(
                    PROMPT, request_id=f"as-{i}", max_tokens=4 + i, ignore_eos=True
                )
            await session.close()
            async for batch in session:
                for rid, new in batch.tokens.items():
                    tokens.setdefault(rid, []).extend(new)
        return tokens

    assert asyncio.run(main()) == {f"as-{i}": want(f"as-{i}", PROMPT, 4 + i) for i in range(3)}


def test_session_abort_with_stop_finishes_the_request_as_stopped(address: str) -> None:
    async def main() -> dict[str, str]:
        reasons: dict[str, str] = {}
        async with AsyncClient(address, timeout=30) as client, client.session() as session:
            for rid in ("sa-stop", "sa-abort"):
                await session.submit(PROMPT, request_id=rid, max_tokens=LONG, ignore_eos=True)
            seen: set[str] = set()
            async for batch in session:
                for rid in batch.tokens:
                    if rid not in seen:  # running: end it, one as stopped, one as aborted
                        seen.add(rid)
                        await session.abort(rid, stop=rid == "sa-stop")
                for f in batch.finished:
                    reasons[f.request_id] = f.reason
                if len(reasons) == 2:
                    break
        return reasons

    assert asyncio.run(main()) == {"sa-stop": "stop", "sa-abort": "abort"}


def test_a_session_abort_with_a_reason_other_than_abort_or_stop_is_refused_in_band(
    address: str,
) -> None:
    from kvsched.client.types import build_request
    from kvsched.v1 import common_pb2, request_service_pb2_grpc
    from kvsched.v1 import request_service_pb2 as rpb

    req = build_request(PROMPT, {"request_id": "sa-bad", "max_tokens": 5, "ignore_eos": True})
    msgs = [
        rpb.SessionRequest(submit=rpb.SessionRequest.Submit(request=req, client_tag="t")),
        rpb.SessionRequest(
            abort=rpb.SessionRequest.Abort(
                request_id="sa-bad", reason=common_pb2.FINISH_REASON_LENGTH
            )
        ),
    ]
    with grpc.insecure_channel(address) as channel:
        stub = request_service_pb2_grpc.RequestServiceStub(channel)  # type: ignore[no-untyped-call]
        out = list(stub.Session(iter(msgs), timeout=30))
    errors = [e for m in out for e in m.errors]
    assert [(e.request_id, e.code) for e in errors] == [
        ("sa-bad", grpc.StatusCode.INVALID_ARGUMENT.value[0])
    ]
    assert "ABORT or STOP" in errors[0].message
    # The abort was refused: the request ran to its end.
    finished = [f for m in out for f in m.finished]
    assert [(f.request_id, f.reason) for f in finished] == [
        ("sa-bad", common_pb2.FINISH_REASON_LENGTH)
    ]


def test_abort_ends_a_running_request_and_unknown_is_not_found(address: str) -> None:
    with Client(address, timeout=30) as client:
        stream = client.generate(PROMPT, request_id="to-abort", max_tokens=LONG, ignore_eos=True)
        first = next(iter(stream))
        assert first
        client.abort("to-abort")
        rest = stream.tokens()
        assert stream.finished is not None and stream.finished.reason == "abort"
        assert stream.finished.usage.output_tokens == len(first) + len(rest)
        client.abort("to-abort")  # already finished: OK, no effect
        with pytest.raises(NotFound) as err:
            client.abort("never-submitted")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and err.value.request_id == "never-submitted"
    assert "never-submitted" in err.value.message


def test_status_and_unknown_instance(address: str) -> None:
    with Client(address, timeout=10) as client:
        st = client.status()
        (inst,) = st.instances
        assert (inst.instance_id, inst.ready, inst.num_gpu_blocks > 0) == ("i0", True, True)
        assert client.status("i0").instances[0].instance_id == "i0"
        with pytest.raises(NotFound) as err:
            client.status("no-such-instance")
    assert "no-such-instance" in err.value.message


def test_invalid_argument_is_typed_and_names_the_field(address: str) -> None:
    with Client(address, timeout=10) as client:
        with pytest.raises(InvalidArgument) as empty:
            client.generate([])
        with pytest.raises(InvalidArgument) as negative:
            client.generate(PROMPT, max_tokens=-1)
    assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in empty.value.message
    assert "max_tokens" in negative.value.message
    assert isinstance(empty.value, KvschedClientError)


def test_deadline_exceeded_mid_stream_aborts_the_request(address: str) -> None:
    async def main() -> None:
        async with AsyncClient(address) as client:
            stream = await client.generate(
                PROMPT, request_id="deadline-a", max_tokens=LONG, ignore_eos=True, timeout=1.0
            )
            with pytest.raises(DeadlineExceeded):
                await stream.tokens()

    asyncio.run(main())
    with Client(address, timeout=0.5) as client:  # the client's default deadline
        stream = client.generate(PROMPT, request_id="deadline-s", max_tokens=LONG, ignore_eos=True)
        with pytest.raises(DeadlineExceeded) as err:
            stream.tokens()
    assert err.value.request_id == "deadline-s"
    wait_pool_free(address)  # both cut streams were aborted: nothing left running


# ---- bearer tokens over TLS ------------------------------------------------------------------

TOKENS = {"client": "client-token-0123456789abcdef", "admin": "admin-token-0123456789abcdef"}
WORKER_TOKEN = "worker-token-0123456789abcdef"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A daemon with TLS and --auth-file; yields (address, CA certificate path)."""
    tmp = tmp_path_factory.mktemp("client-auth")
    (tmp / "tokens").write_text(
        f"client {TOKENS['client']}\nadmin {TOKENS['admin']}\nworker {WORKER_TOKEN}\n"
    )
    ca = CertAuthority(tmp)
    server = ca.issue("server", server=True)
    daemon, addr = start_daemon(
        "--auth-file", str(tmp / "tokens"), "--tls-cert", server.cert_path,
        "--tls-key", server.key_path,
    )  # fmt: skip
    worker = start_worker(
        addr, "i0", "--zero-cost", "--token", WORKER_TOKEN, "--tls-ca", ca.pem.cert_path
    )
    try:
        worker.wait_for("welcomed by", 30)
        yield addr, ca.pem.cert_path
    finally:
        worker.stop()
        daemon.stop()


def test_tokens_over_tls_and_typed_auth_errors(secured: tuple[str, str]) -> None:
    addr, ca = secured
    with Client(addr, tls_ca=ca, token=TOKENS["client"], timeout=30) as client:
        stream = client.generate(PROMPT, request_id="tls-1", max_tokens=6, ignore_eos=True)
        assert stream.tokens() == want("tls-1", PROMPT, 6)
        with pytest.raises(PermissionDenied) as denied:  # a client token on AdminService
            client.status()
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    with Client(addr, tls_ca=ca, token=TOKENS["admin"], timeout=10) as admin:
        assert admin.status().instances[0].ready
    for token in ("", "not-a-token"):
        with (
            Client(addr, tls_ca=ca, token=token, timeout=10) as anon,
            pytest.raises(Unauthenticated) as err,
        ):
            anon.generate(PROMPT, max_tokens=3)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and err.value.message
    # A refused Session stream raises the same typed error when read.
    with Client(addr, tls_ca=ca, timeout=10) as anon, anon.session() as session:
        session.submit(PROMPT, max_tokens=3)
        with pytest.raises(Unauthenticated):
            list(session)


# ---- docs/CLIENT.md ----------------------------------------------------------------------------


def test_the_docs_examples_run_as_written(address: str) -> None:
    """Every ```python block of docs/CLIENT.md runs against the daemon (its address put in for
    the documented default) and prints what the doc says it prints."""
    text = (REPO / "docs" / "CLIENT.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3
    outputs = []
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.replace("127.0.0.1:50051", address), "CLIENT.md", "exec"), {})
        outputs.append(out.getvalue())
    sync, asynchronous, resuming = outputs
    assert re.search(r"^finished length 8 tokens", sync, re.M), sync
    assert "refused: INVALID_ARGUMENT" in sync and "prompt_token_ids is empty" in sync
    assert len(re.findall(r"^accepted \d as \S+$", asynchronous, re.M)) == 3, asynchronous
    assert len(re.findall(r"^finished length", asynchronous, re.M)) == 4, asynchronous
    assert resuming == "finished length 64 tokens, 0 resume(s)\n", resuming  # nothing broke


def test_client_imports_neither_the_daemon_nor_the_worker() -> None:
    for path in (REPO / "kvsched" / "client").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import) (kvsched\.\w+)", path.read_text(), re.M)
        assert set(imports) <= {"kvsched.client", "kvsched.v1", "kvsched.tls"}, path
