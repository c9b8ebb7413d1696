"""Accepted records pipelined (kvsched/durability/acks.py): concurrent accepts share one publish
round and one flush, and each still waits for its own JetStream acknowledgement. Real
nats-server (and, for the cut, the chaos proxy holding bytes); no mocks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from bench.chaos.proxy import ProxySet
from kvsched.client import AsyncClient
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.core import Request, Unavailable
from kvsched.core.journal_state import JournalState
from kvsched.durability import records as R
from kvsched.durability.journal import Journal
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.durability_kit import daemon_behind_proxy, pool_free, sim_expected


@dataclass
class Rec:
    """A request as the journal reads it (the daemon's `Tracked` carries the same fields)."""

    req: Request
    owner: str = "alice"
    client_tag: str = ""
    finished: bool = False
    journal_state: JournalState = JournalState.NONE
    journaled: int = 0
    seen: list[str] = field(default_factory=list)


def recs(prefix: str, n: int) -> list[Rec]:
    return [Rec(Request(f"{prefix}-{i}", [3, 4, 5, i + 6])) for i in range(n)]


def pb_of(rec: Rec) -> rpb.GenerateRequest:
    return rpb.GenerateRequest(request_id=rec.req.req_id, prompt_token_ids=rec.req.prompt_token_ids)


async def stored_ids(journal: Journal, daemon_id: str) -> set[str]:
    return {u.record.request_id for u in await journal.recover(daemon_id)}


def test_concurrent_accepts_share_publish_rounds_and_each_is_stored_when_confirmed(
    nats_server: NatsServer,
) -> None:
    async def scenario() -> None:
        link = await connect_cluster(nats_server.url, "jp-a")
        journal = Journal(link)
        await journal.open()
        try:
            batch = recs("jp", 64)
            futs = [journal.begin_accept(r, pb_of(r), "i0") for r in batch]  # one tick
            assert all(r.journal_state == JournalState.IN_FLIGHT for r in batch)
            # Each confirmation is followed by a read of the stream: the record is there.
            found: list[bool] = []
            for r, f in zip(batch, futs, strict=True):
                await asyncio.wait_for(f, 10)
                assert r.journal_state == JournalState.STORED
                last = await link.js.get_last_msg(R.STREAM, R.req_subject("jp-a", r.req.req_id))
                found.append(R.parse_record(last.data).request_id == r.req.req_id)
            assert all(found)
            assert journal.num_accepted == 64 and journal.num_refused == 0
            assert journal.acks.num_published == 64
            assert journal.acks.num_batches < 64  # pipelined: rounds shared by several records
            assert await stored_ids(journal, "jp-a") == {r.req.req_id for r in batch}
        finally:
            await link.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_record_the_stream_refuses_fails_alone_in_its_round(nats_server: NatsServer) -> None:
    """JetStream's error acknowledgement (here a compare-and-set that does not hold) refuses
    that record only; its neighbours in the same round are stored; a subject no stream takes
    is refused too (no responders), never confirmed."""

    async def scenario() -> None:
        link = await connect_cluster(nats_server.url, "jp-b")
        journal = Journal(link)
        await journal.open()
        try:
            acks = journal.acks
            good = [acks.publish(f"{R.REQ}.jp-b.g{i}", b"x") for i in range(5)]
            bad = acks.publish(
                f"{R.REQ}.jp-b.bad", b"x", {"Nats-Expected-Last-Subject-Sequence": "999999"}
            )
            nowhere = acks.publish("not.a.journal.subject", b"x")
            await asyncio.wait_for(asyncio.gather(*good), 10)
            with pytest.raises(Exception) as bad_exc:
                await asyncio.wait_for(bad, 10)
            assert "sequence" in str(bad_exc.value).lower(), bad_exc.value
            with pytest.raises(Exception) as nowhere_exc:
                await asyncio.wait_for(nowhere, 10)
            assert type(nowhere_exc.value).__name__ == "NoStreamResponseError"
            assert acks.in_flight == 0
        finally:
            await link.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.faults  # a partition scenario: `make test-faults`
def test_a_nats_cut_during_a_pipelined_round_refuses_exactly_the_unacknowledged_records(
    nats_server: NatsServer,
) -> None:
    """Records acknowledged before the cut stay stored; the round sent into the cut (its bytes
    held by the proxy, the connection open) gets no acknowledgement within journal_timeout_s:
    every one of them is refused, and once the link heals and the held records land, their
    purges follow them: the journal holds exactly the acknowledged ones."""
    proxies = ProxySet()

    async def scenario() -> None:
        addr = proxies.add("nats-jp", f"127.0.0.1:{nats_server.port}")
        link = await connect_cluster(f"nats://{addr}", "jp-c")
        probe = await connect_cluster(nats_server.url, "jp-probe")
        journal = Journal(link, timeout_s=1.0)
        await journal.open()
        writer = asyncio.get_running_loop().create_task(journal.run(lambda: []))
        try:
            before = recs("jc-acked", 16)
            await asyncio.gather(*(journal.begin_accept(r, pb_of(r), "i0") for r in before))
            assert all(r.journal_state == JournalState.STORED for r in before)

            proxies.cut(["nats-jp"])
            during = recs("jc-cut", 16)
            futs = [journal.begin_accept(r, pb_of(r), "i0") for r in during]
            outcomes = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
            assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
            assert "did not acknowledge" in str(outcomes[0])
            assert all(r.journal_state == JournalState.NONE for r in during)
            assert all(r.journal_state == JournalState.STORED for r in before)
            assert journal.num_refused == 16 and journal.num_accepted == 16

            proxies.heal(["nats-jp"])
            probe_journal = Journal(probe)
            want = {r.req.req_id for r in before}
            deadline, got = time.monotonic() + 30.0, set()
            while time.monotonic() < deadline:
                got = await stored_ids(probe_journal, "jp-c")
                if got == want:
                    break
                await asyncio.sleep(0.5)
            assert got == want, sorted(got ^ want)
        finally:
            writer.cancel()
            await link.close()
            await probe.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        proxies.close()


@pytest.mark.faults  # a partition scenario: `make test-faults`
def test_session_submits_during_a_nats_cut_are_refused_each_and_nothing_is_kept(
    nats_server: NatsServer,
) -> None:
    """A Session's submits wait for the journal without a task each (the acknowledgement's
    callback tells the client): during a cut, every one is answered by an UNAVAILABLE error
    naming the journal, never `accepted`, no token of them is sent, their blocks come back;
    after the heal the same session's next submit is accepted and exact."""
    env = {"KVSCHED_JOURNAL_TIMEOUT_S": "1"}
    with daemon_behind_proxy(nats_server.port, "jp-s", "js0", env) as (proxies, daemon):
        address = daemon.address

        async def scenario() -> None:
            async with AsyncClient(address) as client:
                session = client.session()
                proxies.cut(["nats-js"])
                cut = [f"cut-{i}" for i in range(6)]
                for rid in cut:
                    await session.submit([3, 4, 5], request_id=rid, client_tag=rid, max_tokens=50)
                accepted: set[str] = set()
                errors: dict[str, str] = {}
                tokens: dict[str, list[int]] = {}
                finished: set[str] = set()
                it = session.__aiter__()
                while len(errors) < len(cut):
                    batch = await asyncio.wait_for(it.__anext__(), 30)
                    accepted |= {a.request_id for a in batch.accepted}
                    errors |= {e.client_tag: e.message for e in batch.errors}
                assert set(errors) == set(cut) and not accepted
                assert all("journal" in m and "nothing was accepted" in m for m in errors.values())
                proxies.heal(["nats-js"])
                # The link works again: a new submit on the same session is accepted (a few
                # tries: the first may still meet the held bytes' backlog).
                deadline = time.monotonic() + 30
                for n in range(60):
                    assert time.monotonic() < deadline, errors
                    rid = f"after-{n}"
                    await session.submit([3, 4, 5], request_id=rid, client_tag=rid, max_tokens=8)
                    while rid not in errors and rid not in finished:
                        batch = await asyncio.wait_for(it.__anext__(), 30)
                        accepted |= {a.request_id for a in batch.accepted}
                        errors |= {e.client_tag: e.message for e in batch.errors}
                        for r, toks in batch.tokens.items():
                            assert r in accepted, f"tokens of {r} before it was accepted"
                            tokens.setdefault(r, []).extend(toks)
                        finished |= {f.request_id for f in batch.finished}
                    if rid in finished:
                        break
                assert tokens[rid] == sim_expected(rid, 3, 8)
                assert not set(cut) & (accepted | set(tokens) | finished)
                await session.close()

        asyncio.run(asyncio.wait_for(scenario(), 120))
        pool_free(address)


def test_a_refused_records_tombstone_reads_as_no_record_not_as_one_changing_owner(
    nats_server: NatsServer,
) -> None:
    """The 30-minute run of 6c16cbb refused a client's Resume 2.1-2.2 s after a partition
    healed ("changing owner in the journal; retry"): the daemon cut off from NATS had refused
    the request (nothing accepted), the tombstone that follows a refused record was delivered
    at the heal and lived 2 s, and a lookup read any tombstone naming no adopter as a record
    changing hands. A refused record's tombstone is marked; a lookup reads it as no record (a
    client then submits again), or finds the request's record under another daemon, accepted
    there before the tombstone landed. An unmarked tombstone still means "retry"."""

    async def scenario() -> None:
        link = await connect_cluster(nats_server.url, "rf-a")
        journal = Journal(link)
        await journal.open()
        try:
            js = link.js
            # Refused at rf-a: its accepted record, then the marked tombstone, as delivered late.
            lone = rpb.GenerateRequest(request_id="rf-1", prompt_token_ids=[3, 4])
            await js.publish(
                R.req_subject("rf-a", "rf-1"), R.accepted_record(lone, "rf-1", "rf-a", "i0", "", "")
            )
            await js.publish(R.req_subject("rf-a", "rf-1"), b"", headers=R.REFUSED_HEADERS)
            assert await journal.lookup("rf-1") is None
            # Accepted at rf-b meanwhile, then rf-a's refusal lands: rf-b's record is found.
            again = rpb.GenerateRequest(request_id="rf-2", prompt_token_ids=[5, 6])
            await js.publish(
                R.req_subject("rf-b", "rf-2"),
                R.accepted_record(again, "rf-2", "rf-b", "i1", "", ""),
            )
            await js.publish(R.req_subject("rf-a", "rf-2"), b"", headers=R.REFUSED_HEADERS)
            rec = await journal.lookup("rf-2")
            assert rec is not None and rec.daemon_id == "rf-b" and rec.kind == R.ACCEPTED
            # A tombstone naming nobody, unmarked: a record changing hands.
            await js.publish(R.req_subject("rf-a", "rf-3"), b"", headers=R.TOMBSTONE_HEADERS)
            with pytest.raises(Unavailable, match="changing owner"):
                await journal.lookup("rf-3")
        finally:
            await journal.close([])
            await link.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
