"""Clients that batch submits, against a daemon from before SessionRequest.batch (the repository's
own code at OLD, taken from its git history and run as a user would run it): that daemon
answers a batch with one error naming no submit and never runs them, so a client sends
batches only to a daemon whose initial metadata announced them. Against the old daemon the
client library's `submit_many_built`, the front end's Session link and the replay send single
submits, and every request runs. Skipped where the checkout has no history (a tarball, a
shallow clone)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
from collections.abc import Iterator

import grpc
import pytest

from kvsched.client import AsyncClient
from kvsched.client.types import build_request, build_submit
from kvsched.http.backend import Backend
from kvsched.replay import runner
from kvsched.traces import TraceRequest
from kvsched.v1 import request_service_pb2 as rpb
from kvsched.v1 import request_service_pb2_grpc
from tests.http.test_session_batch import _drain, _opts
from tests.integration.clients import expected_tokens
from tests.integration.harness import REPO, Proc, wait_ready

OLD = "038e9595a3590de2a8c73ecfd853d909870a3fab"  # main just before SessionRequest.batch
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def old_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        tar = subprocess.run(
            ["git", "archive", OLD, "kvsched"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip(f"commit {OLD[:10]} is not in this checkout's history")
    old = tmp_path_factory.mktemp("old-kvsched")
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:  # this repository's own files
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            archive.extractall(old, filter="data")
        else:
            archive.extractall(old)
    env = {"PYTHONPATH": str(old)}
    daemon = Proc(
        ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off"], env, "old-daemon", old
    )
    procs = [daemon]
    try:
        address = daemon.wait_for(r"kvsched listening on (\S+:\d+)").group(1)
        args = ["worker", "--server", address, "--instance", "i0", "--executor", "sim"]
        procs.append(Proc(args, env, "old-worker", old))
        wait_ready(address, ["i0"])
        yield address
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_old_daemon_leaves_a_batch_unanswered(old_daemon: str) -> None:
    """Why batches wait for the announcement: what the old daemon does with one."""
    req = build_request(PROMPT, {"request_id": "o1", "max_tokens": 3})
    batch = rpb.SessionRequest()
    batch.batch.submits.add(request=req, client_tag="o1")
    with grpc.insecure_channel(old_daemon) as channel:
        stub = request_service_pb2_grpc.RequestServiceStub(channel)  # type: ignore[no-untyped-call]
        call = stub.Session(iter([batch]), timeout=30)
        assert "kvsched-session-batch" not in dict(call.initial_metadata() or ())
        out = list(call)
    errors = [e for m in out for e in m.errors]
    assert [(e.client_tag, e.request_id) for e in errors] == [("", "")]
    assert "must set `submit` or `abort`" in errors[0].message
    assert not [r for m in out for r in m.accepted.request_ids]


def test_submit_many_built_sends_single_submits_to_the_old_daemon(old_daemon: str) -> None:
    ids = [f"s{i}" for i in range(4)]

    async def main() -> tuple[int, tuple[int, int], dict[str, list[int]]]:
        tokens: dict[str, list[int]] = {}
        async with AsyncClient(old_daemon, timeout=60) as client, client.session() as session:
            # A first request answered: the old daemon's initial metadata has come (with it).
            opts = {"max_tokens": 4, "ignore_eos": True}
            await session.submit(PROMPT, client_tag="first", **opts)  # type: ignore[misc]
            reading = aiter(session)
            while not (await anext(reading)).finished:
                pass
            limit = await session.header_read(5.0)
            await session.submit_many_built(
                [build_submit(PROMPT, {**opts, "request_id": r}, r) for r in ids]  # type: ignore[arg-type]
            )
            await session.close()
            async for batch in reading:
                for rid, new in batch.tokens.items():
                    tokens.setdefault(rid, []).extend(new)
            return limit, (session.batches_sent, session.batched_submits), tokens

    limit, counts, tokens = asyncio.run(asyncio.wait_for(main(), 60))
    assert (limit, counts) == (0, (0, 0))
    assert tokens == {r: expected_tokens(r, len(PROMPT), 4, []) for r in ids}


def test_the_front_end_and_the_replay_send_single_submits_to_the_old_daemon(
    old_daemon: str,
) -> None:
    async def front_end() -> int:
        backend = Backend([old_daemon])
        try:
            assert await _drain(backend.submit(PROMPT, _opts("warm", 2), None))
            (link,) = backend._links.values()
            ids = [f"h{i}" for i in range(12)]
            burst = [backend.submit(PROMPT, _opts(r, 3), None) for r in ids]
            got = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in burst)), 60)
            assert got == [expected_tokens(r, len(PROMPT), 3, []) for r in ids]
            return link.batched_submits
        finally:
            await backend.close()

    assert asyncio.run(front_end()) == 0
    reqs = [TraceRequest(0.0, list(range(50 + i, 90 + i)), 3) for i in range(6)]
    result = asyncio.run(runner.replay(old_daemon, reqs, progress=False))
    assert all(r.completed and len(r.token_times_s) == 3 for r in result.records)
