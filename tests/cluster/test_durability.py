"""Durability with a real nats-server, real daemon and worker processes on loopback: a daemon
killed with SIGKILL under load and restarted with the same id loses no accepted request, and
resuming clients get exactly the tokens of an uninterrupted run; the journal refuses requests
it cannot store; NATS restarted under load loses nothing; Resume's typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import pytest

from kvsched.client import AsyncClient, Cancelled, InvalidArgument, NotFound, Unavailable
from kvsched.client.resumable import RESUMABLE_CHANNEL_OPTIONS
from kvsched.cluster.natsd import NatsServer
from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.durability_kit import (
    Daemon,
    pool_free,
    prompts,
    quantiles,
    run_with_kill,
    sim_expected,
    start_sim_worker,
)
from tests.integration.harness import Proc, status, wait_ready


@pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)
def test_kill9_under_load_loses_nothing_and_resumed_tokens_are_exact(
    nats_server: NatsServer,
) -> None:
    daemon = Daemon(nats_server.url, "d1").start()
    workers = [start_sim_worker(daemon.address, iid, "--speed", "0.3") for iid in ("i0", "i1")]
    try:
        wait_ready(daemon.address, ["i0", "i1"])
        ps = prompts(80)
        requests = [(f"kill-{i}", p, 150 + (i % 5) * 30) for i, p in enumerate(ps)]
        t0 = time.monotonic()
        result = asyncio.run(run_with_kill(daemon, ["i0", "i1"], requests, kill_after_tokens=5))
        assert not result.errors, result.errors[:3]
        assert "recovered" in daemon.output()
        for s, (rid, p, n) in zip(result.streams, requests, strict=True):
            assert s.finished is not None and s.finished.reason == "length"
            assert s.tokens == sim_expected(rid, len(p), n), rid  # none missing, none repeated
            assert s.finished.usage.output_tokens == n
        # Most are cut mid-way on a quiet box; a loaded one finishes a few before the kill.
        assert len(result.cut) >= max(1, len(requests) // 4), "streams must be cut mid-way"
        assert all(result.streams[i].resumes for i in result.cut)
        pool_free(daemon.address)
        assert not [i for i in status(daemon.address).instances if i.num_running]
        gaps = result.first_token_after_break_s()
        p50, p99 = quantiles(gaps)
        # The figure, for `pytest -s` (bench/results/durability_kill9.json is bench.failover's
        # to write: a test run must not dirty tracked files).
        print(
            json.dumps(
                {
                    "requests": len(requests),
                    "cut_by_the_kill": len(result.cut),
                    "kill_to_first_token_s": {"p50": p50, "p99": p99, "n": len(gaps)},
                    "wall_s": time.monotonic() - t0,
                },
                indent=1,
            )
        )
        print(f"kill -9 -> first token after recovery: p50 {p50:.3f} s, p99 {p99:.3f} s")
    finally:
        for w in workers:
            w.stop()
        daemon.stop()


def test_journal_unreachable_refuses_with_unavailable_and_keeps_nothing(tmp_path: Path) -> None:
    nats = NatsServer(store_dir=str(tmp_path / "js")).start()
    daemon = Daemon(nats.url, "d2", "--cluster-fallback", "fail").start()
    worker = start_sim_worker(daemon.address, "i0", "--speed", "0.5")
    try:
        wait_ready(daemon.address, ["i0"])

        async def scenario() -> None:
            async with AsyncClient(daemon.address, options=RESUMABLE_CHANNEL_OPTIONS) as client:
                # In flight across the NATS outage: accepted before it, finishes after it.
                before = [
                    await client.generate([5, 6, 7, 8], request_id=f"b{i}", max_tokens=150)
                    for i in range(10)
                ]
                reading = [asyncio.create_task(s.tokens()) for s in before]
                nats.stop()
                with pytest.raises(Unavailable) as err:
                    await client.generate([1, 2, 3], request_id="refused", max_tokens=4)
                assert "journal" in str(err.value) and "nothing was accepted" in str(err.value)
                with pytest.raises(Unavailable):  # unknown here, the journal cannot say
                    await client.resume("refused")
                st = status(daemon.address)
                assert sum(i.num_waiting + i.num_running for i in st.instances) <= 10
                nats.start()
                got = await asyncio.gather(*reading)
                for rid, toks in zip([f"b{i}" for i in range(10)], got, strict=True):
                    assert toks == sim_expected(rid, 4, 150)
                # The journal works again once NATS is back (the link reconnects).
                deadline = time.monotonic() + 20
                while True:
                    try:
                        s = await client.generate([1, 2, 3], request_id="after", max_tokens=4)
                        break
                    except Unavailable:
                        assert time.monotonic() < deadline, "journal did not heal"
                        await asyncio.sleep(0.2)
                assert await s.tokens() == sim_expected("after", 3, 4)
                with pytest.raises(NotFound):  # nothing of the refused request was kept
                    await client.resume("refused")

        asyncio.run(asyncio.wait_for(scenario(), 90))
        pool_free(daemon.address)
    finally:
        worker.stop()
        daemon.stop()
        nats.close()


def test_resume_errors_finished_requests_and_sessions(nats_server: NatsServer) -> None:
    daemon = Daemon(nats_server.url, "d3").start()
    worker = start_sim_worker(daemon.address, "i0", "--speed", "0.2")
    try:
        wait_ready(daemon.address, ["i0"])

        async def scenario() -> None:
            async with AsyncClient(daemon.address) as client:
                with pytest.raises(NotFound):
                    await client.resume("never-submitted")
                done = await client.generate([9, 9, 9], request_id="done", max_tokens=8)
                toks = await done.tokens()
                # Finished: the rest from the journal's finished record, then its finished.
                rest = await client.resume("done", toks[:3])
                assert await rest.tokens() == toks[3:]
                assert rest.finished is not None and rest.finished.usage.output_tokens == 8
                with pytest.raises(InvalidArgument):
                    await client.resume("done", toks + [1])  # more than it produced
                with pytest.raises(InvalidArgument):
                    await client.resume("done", [toks[0] + 1])  # not its tokens
                # A detachable request whose client went away: resumed, then its old stream
                # ends quietly and the new one gets each token once.
                s1 = await client.generate(
                    [4, 4], request_id="det", max_tokens=200, detachable=True
                )
                held: list[int] = []
                async for batch in s1:
                    held += batch
                    if len(held) >= 5:
                        break
                s1.cancel()
                s2 = await client.resume("det", held)
                assert held + await s2.tokens() == sim_expected("det", 2, 200)

        asyncio.run(asyncio.wait_for(scenario(), 60))
        # A Session's request resumed on its own stream leaves the session, which then ends.
        with grpc.insecure_channel(daemon.address) as ch:
            stub = request_service_pb2_grpc.RequestServiceStub(ch)
            sub = rpb.SessionRequest(
                submit=rpb.SessionRequest.Submit(
                    request=rpb.GenerateRequest(
                        request_id="sess",
                        prompt_token_ids=[1, 2],
                        sampling=common_pb2.SamplingParams(max_tokens=200),
                    )
                )
            )
            sess = stub.Session(iter([sub]), timeout=30)
            seen: list[int] = []
            for msg in sess:
                seen += list(msg.tokens.token_ids)
                if seen:
                    break
            resumed = stub.Resume(
                rpb.RequestServiceResumeRequest(request_id="sess", token_ids=seen), timeout=30
            )
            rest = [t for m in resumed if m.HasField("tokens") for t in m.tokens.token_ids]
            assert seen + rest == sim_expected("sess", 2, 200)
            for msg in sess:  # the session ends without a finished for the request it lost
                assert not msg.finished
        pool_free(daemon.address)
    finally:
        worker.stop()
        daemon.stop()


def test_kill9_with_model_workers_resumed_outputs_equal_the_unpaged_reference(
    nats_server: NatsServer,
) -> None:
    from tests.e2e.harness import make_prompt, reference

    daemon = Daemon(nats_server.url, "d4").start()
    args = ["--num-slots", "16", "--num-blocks", "256", "--block-size", "8", "--backend", "numpy"]
    workers = [
        Proc(
            ["worker", "--server", daemon.address, "--instance", iid, "--executor", "model", *args],
            name=f"model-{iid}",
        )
        for iid in ("m0", "m1")
    ]
    try:
        wait_ready(daemon.address, ["m0", "m1"], timeout=60)
        requests = [(f"model-{i}", make_prompt(i, 8 + 5 * i), 40) for i in range(12)]
        result = asyncio.run(
            run_with_kill(daemon, ["m0", "m1"], requests, kill_after_tokens=3, timeout_s=150)
        )
        assert not result.errors, result.errors[:3]
        assert len(result.cut) >= max(1, len(requests) // 4)  # cut mid-way (a loaded box: fewer)
        for s, (rid, p, n) in zip(result.streams, requests, strict=True):
            assert s.finished is not None and s.finished.usage.output_tokens == n
            assert s.tokens == reference(p, n), rid
        pool_free(daemon.address)
    finally:
        for w in workers:
            w.stop()
        daemon.stop()


@pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)
def test_soak_with_daemon_kills_loses_nothing_and_leaks_nothing() -> None:
    from bench.soak import soak

    fig = soak(seconds=14, seed=11, daemon_kill_every_s=5)
    assert fig.daemon_kills >= 2 and fig.worker_kills >= 1 and fig.completed > 50
    assert fig.lost == 0 and fig.finished_twice == 0 and fig.wrong_tokens == 0
    assert fig.leaked_blocks == 0 and fig.left_running_or_waiting == 0


def test_session_with_journal_announces_before_tokens_and_streams_exact_tokens(
    nats_server: NatsServer,
) -> None:
    daemon = Daemon(nats_server.url, "d5").start()
    worker = start_sim_worker(daemon.address, "i0", "--speed", "2")
    try:
        wait_ready(daemon.address, ["i0"])

        async def scenario() -> None:
            async with AsyncClient(daemon.address) as client:
                session = client.session()
                want = {f"s{i}": (i % 7 + 1, 5 + i % 40) for i in range(60)}
                for rid, (plen, n) in want.items():
                    await session.submit(list(range(3, 3 + plen)), request_id=rid, max_tokens=n)
                await session.submit([5], request_id="s-aborted", max_tokens=5000)
                await session.abort("s-aborted")
                await session.close()
                accepted: set[str] = set()
                got: dict[str, list[int]] = {}
                finished: dict[str, str] = {}
                async for batch in session:
                    accepted |= {a.request_id for a in batch.accepted}
                    for rid, toks in batch.tokens.items():
                        assert rid in accepted, f"tokens of {rid} before it was accepted"
                        got.setdefault(rid, []).extend(toks)
                    for f in batch.finished:
                        assert f.request_id not in finished
                        finished[f.request_id] = f.reason
                assert finished.pop("s-aborted") == "abort"
                assert set(finished) == set(want)
                for rid, (plen, n) in want.items():
                    assert got[rid] == sim_expected(rid, plen, n), rid

        asyncio.run(asyncio.wait_for(scenario(), 60))
        pool_free(daemon.address)
    finally:
        worker.stop()
        daemon.stop()


def test_resume_of_another_callers_request_is_permission_denied(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    from kvsched.client import PermissionDenied

    auth = tmp_path / "tokens"
    auth.write_text(
        "client token-a-0123456789abcdef\nclient token-b-0123456789abcdef\nworker token-w-0123456789abcdef\n"
    )
    daemon = Daemon(nats_server.url, "d6", "--auth-file", str(auth)).start()
    worker = start_sim_worker(
        daemon.address, "i0", "--speed", "0.2", "--token", "token-w-0123456789abcdef"
    )
    try:
        assert daemon.proc is not None
        daemon.proc.wait_for("worker connected: instance i0")

        async def scenario() -> None:
            async with (
                AsyncClient(daemon.address, token="token-a-0123456789abcdef") as a,
                AsyncClient(daemon.address, token="token-b-0123456789abcdef") as b,
            ):
                s = await a.generate([1, 2], request_id="mine", max_tokens=30, detachable=True)
                with pytest.raises(PermissionDenied):  # live
                    await b.resume("mine")
                toks = await s.tokens()
                with pytest.raises(PermissionDenied):  # finished: the journal's record
                    await b.resume("mine", toks[:3])
                rest = await a.resume("mine", toks[:3])
                assert toks[:3] + await rest.tokens() == toks == sim_expected("mine", 2, 30)

        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        worker.stop()
        daemon.stop()


def test_sigterm_drain_closes_every_journal_record(nats_server: NatsServer) -> None:
    """A graceful stop ends its requests (drain, then abort) and writes their finished records
    before it leaves: restarted under the same id, the daemon recovers none of them."""
    daemon = Daemon(nats_server.url, "d7", "--log-level", "info")
    daemon.start()
    worker = start_sim_worker(daemon.address, "i0", "--speed", "0.05")
    try:
        wait_ready(daemon.address, ["i0"])

        async def submit() -> list[str]:
            async with AsyncClient(daemon.address) as client:
                ids = []
                for i in range(20):
                    await client.generate(
                        [3, 4, 5], request_id=f"drain-{i}", max_tokens=5000, detachable=True
                    )
                    ids.append(f"drain-{i}")
                return ids

        ids = asyncio.run(asyncio.wait_for(submit(), 30))
        assert daemon.proc is not None
        daemon.proc.signal()  # SIGTERM: drain for grace_period_s (1 s here), then abort
        assert daemon.proc.wait(30) == 0
        daemon.start()
        assert "recovered" not in daemon.output()

        async def check() -> None:
            async with AsyncClient(daemon.address) as client:
                for rid in ids:
                    done = await client.resume(rid)
                    await done.tokens()
                    assert done.finished is not None and done.finished.reason == "abort"

        asyncio.run(asyncio.wait_for(check(), 30))
    finally:
        worker.stop()
        daemon.stop()


def test_another_daemon_takes_over_a_dead_daemons_requests_exactly_once(
    nats_server: NatsServer,
) -> None:
    """`--take-over ID`: a daemon with another id adopts a dead daemon's unfinished requests
    (compare-and-set per request: a second taker gets none); clients resume there and get
    exactly the tokens of an uninterrupted run."""
    a = Daemon(nats_server.url, "ta").start()
    wa = start_sim_worker(a.address, "i0", "--speed", "0.3")
    procs = [wa]
    daemons = [a]
    try:
        wait_ready(a.address, ["i0"])
        requests = [(f"to-{i}", p, 150) for i, p in enumerate(prompts(30, seed=3))]
        held: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}

        async def before_the_kill() -> None:
            async with AsyncClient(a.address) as client:
                streams = [
                    await client.generate(p, request_id=rid, max_tokens=n) for rid, p, n in requests
                ]

                async def read(rid: str, s: object) -> None:
                    with contextlib.suppress(Unavailable, Cancelled):
                        async for batch in s:  # type: ignore[attr-defined]
                            held[rid] += batch

                readers = [
                    asyncio.create_task(read(r, s))
                    for (r, _, _), s in zip(requests, streams, strict=True)
                ]
                while any(len(t) < 3 for t in held.values()):
                    await asyncio.sleep(0.02)
                a.kill9()
                await asyncio.wait_for(asyncio.gather(*readers), 30)

        asyncio.run(asyncio.wait_for(before_the_kill(), 60))
        wa.stop()
        b = Daemon(nats_server.url, "tb", "--take-over", "ta").start()
        daemons.append(b)
        assert b.proc is not None and b.proc.wait_for(r"took over (\d+) request").group(1) == "30"
        c = Daemon(nats_server.url, "tc", "--take-over", "ta").start()
        daemons.append(c)
        assert c.proc is not None and c.proc.wait_for(r"took over (\d+) request").group(1) == "0"
        procs.append(start_sim_worker(b.address, "i0", "--speed", "0.3"))  # its worker, moved
        wait_ready(b.address, ["i0"])

        async def after() -> None:
            async with AsyncClient(b.address) as client:
                for rid, p, n in requests:
                    rest = await client.resume(rid, held[rid])
                    assert held[rid] + await rest.tokens() == sim_expected(rid, len(p), n), rid

        asyncio.run(asyncio.wait_for(after(), 90))
        pool_free(b.address)
    finally:
        for w in procs:
            w.stop()
        for d in daemons:
            d.stop()
