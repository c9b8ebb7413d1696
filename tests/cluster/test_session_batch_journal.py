"""A batch of Session submits (SessionRequest.batch) on a daemon with the journal: each submit
is journaled and told `accepted` from its own acknowledgement, as a single submit is (the
journal holds each one's finished record); a bad one is refused alone (nothing journaled) while the others run to their exact tokens. Real
nats-server, daemon and sim worker on loopback."""

from __future__ import annotations

import asyncio

from nats.js.errors import NotFoundError

from kvsched.client import AsyncClient
from kvsched.client.types import build_submit
from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.durability import records as R
from tests.cluster.durability_kit import Daemon, pool_free, sim_expected, start_sim_worker
from tests.integration.harness import wait_ready

PROMPT = [3, 4, 5, 6]


def test_each_submit_of_a_batch_is_journaled_and_answered_alone(nats_server: NatsServer) -> None:
    daemon = Daemon(nats_server.url, "sbj").start()
    worker = start_sim_worker(daemon.address, "i0")
    ids = ["j0", "j1", "bad", "j3"]

    async def scenario() -> tuple[int, dict[str, list[int]], dict[str, str], dict[str, str]]:
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        errors: dict[str, str] = {}
        async with AsyncClient(daemon.address) as client, client.session() as session:
            assert await session.header_read(10.0) > 0
            msgs = [
                build_submit(
                    [3, 4, 10**9] if rid == "bad" else PROMPT,  # bad: outside the vocabulary
                    {"request_id": rid, "max_tokens": 6, "ignore_eos": True},
                    rid,
                )
                for rid in ids
            ]
            await session.submit_many_built(msgs)
            await session.close()
            async for batch in session:
                for rid, new in batch.tokens.items():
                    tokens.setdefault(rid, []).extend(new)
                reasons.update((f.request_id, f.reason) for f in batch.finished)
                errors.update((e.client_tag, e.message) for e in batch.errors)
            return session.batched_submits, tokens, reasons, errors

    async def journaled() -> dict[str, bool]:
        """Whether the journal holds each request's finished record."""
        link = await connect_cluster(nats_server.url, "sbj-reader")
        try:
            out = {}
            for rid in ids:
                try:
                    await link.js.get_last_msg(R.STREAM, R.done_subject(rid))
                    out[rid] = True
                except NotFoundError:
                    out[rid] = False
            return out
        finally:
            await link.close()

    try:
        wait_ready(daemon.address, ["i0"], 60.0)
        batched, tokens, reasons, errors = asyncio.run(asyncio.wait_for(scenario(), 60))
        good = [r for r in ids if r != "bad"]
        assert batched == 4
        assert list(errors) == ["bad"] and "vocab" in errors["bad"]
        assert reasons == dict.fromkeys(good, "length")
        assert tokens == {r: sim_expected(r, len(PROMPT), 6) for r in good}
        assert asyncio.run(journaled()) == {r: r != "bad" for r in ids}
        pool_free(daemon.address)
    finally:
        worker.stop()
        daemon.stop()
