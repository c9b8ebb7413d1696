"""Resume of a request whose accepted record is still in flight to the journal (a real daemon,
sim worker and nats-server; the chaos proxy holds the journal's bytes; no mocks).

Found by the 30-minute nemesis run of seed 2: a daemon cut off from NATS ran a request while
its accepted record was in flight; the client, told nothing within 2 s, resumed it there, was
streamed 91 tokens, and then got Finished(abort, "refused: the journal did not store the
request") when the write timed out: an accepted request (for its client) that ended with an
error. A request is accepted only once its record is stored, so a Resume waits for the write:
refused, the answer is NOT_FOUND (never accepted: the client submits it again); stored, the
Resume streams it exactly like any live request."""

from __future__ import annotations

import asyncio

import pytest

from kvsched.client import AsyncClient
from kvsched.client.errors import KvschedClientError, NotFound, Unavailable
from kvsched.cluster.natsd import NatsServer
from tests.cluster.durability_kit import daemon_behind_proxy, pool_free, sim_expected

PROMPT = [3, 4, 5]


async def _submit(client: AsyncClient, rid: str, max_tokens: int) -> list[int] | BaseException:
    """A Generate that may be refused or taken over (returned as the exception), or run to
    its end."""
    try:
        stream = await client.generate(
            PROMPT, request_id=rid, max_tokens=max_tokens, detachable=True
        )
        return await stream.tokens()
    except KvschedClientError as exc:
        return exc


@pytest.mark.faults  # a partition scenario: `make test-faults`
def test_a_resume_waits_for_the_journal_write_refused_not_found_stored_streamed(
    nats_server: NatsServer,
) -> None:
    env = {"KVSCHED_JOURNAL_TIMEOUT_S": "2"}
    with daemon_behind_proxy(nats_server.port, "rif", "rif0", env) as (proxies, daemon):
        address = daemon.address

        async def scenario() -> None:
            async with AsyncClient(address) as client:
                # 1. Refused: the cut outlasts journal_timeout_s. The request runs meanwhile
                # (the write is pipelined); its Resume must not be streamed its tokens.
                proxies.cut(["nats-js"])
                gen = asyncio.ensure_future(_submit(client, "refused-1", 400))
                await asyncio.sleep(0.6)  # accepted here, its record in flight, running
                with pytest.raises(NotFound, match="not accepted"):
                    stream = await client.resume("refused-1", [], timeout=30)
                    got = await stream.tokens()  # (without the wait: tokens, then an abort)
                    pytest.fail(f"resumed a refused request: {len(got)} tokens, {stream.finished}")
                refused = await asyncio.wait_for(gen, 30)
                assert isinstance(refused, Unavailable), refused
                assert "journal" in str(refused)
                proxies.heal(["nats-js"])
                await asyncio.sleep(1.0)  # the held bytes drain; the link is plain again

                # 2. Stored: the cut is healed before journal_timeout_s; the Resume waits for
                # the record, then takes the stream over and reads it exactly to its end.
                proxies.cut(["nats-js"])
                gen = asyncio.ensure_future(_submit(client, "stored-1", 200))
                await asyncio.sleep(0.6)
                resume = asyncio.ensure_future(client.resume("stored-1", [], timeout=30))
                await asyncio.sleep(0.4)
                assert not resume.done(), "answered while the record was still in flight"
                proxies.heal(["nats-js"])
                stream = await asyncio.wait_for(resume, 30)
                tokens = await stream.tokens()
                assert stream.finished is not None and stream.finished.reason == "length"
                assert tokens == sim_expected("stored-1", len(PROMPT), 200)
                # The Generate's stream was taken over: it ends without a Finished of its own.
                first = await asyncio.wait_for(gen, 30)
                assert isinstance(first, KvschedClientError), first
                assert "without finished" in str(first)

        asyncio.run(asyncio.wait_for(scenario(), 120))
        pool_free(address)
