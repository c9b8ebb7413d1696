"""A journal record that names a live daemon which does not run its request (issue 23, found
by the 30-minute nemesis run): real daemons on a real nats-server, a sim worker, loopback.

In the run a Generate reached daemon d2 while it was cut off from NATS; the accepted record's
write outlived the call (the client had given up after 2 s and the accept was refused), and it
landed when NATS came back. The request was then accepted in the journal and run nowhere: every
Resume, at any daemon, was relayed to d2, which answered "belongs to daemon 'd2', which is not
running" for 40 s (until d2 happened to be killed and recovered its journal). Here that record
is written by hand: the accepted record of `own-1` under `own-a`'s subject, which `own-a` does
not track. A Resume at `own-a` (or through `own-b`) must recover it from the journal, as a
restart would, and serve it: every token once, exactly the sim's, one Finished.
"""

from __future__ import annotations

import asyncio

import pytest

from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer
from kvsched.durability import records as R
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb
from tests.cluster.durability_kit import Daemon, resume_all, sim_expected, start_sim_worker
from tests.integration.clients import Spec
from tests.integration.harness import Proc, wait_ready

pytestmark = pytest.mark.faults  # the residue of a partition: `make test-faults` (a CI step)

MAX_TOKENS = 30


async def _write_accepted(url: str, daemon_id: str, spec: Spec) -> None:
    """The accepted record of `spec` under `daemon_id`, as its journal writes it."""
    link = await connect_cluster(url, "own-writer")
    try:
        pb = spec.message(detachable=True)
        data = R.accepted_record(pb, spec.req_id, daemon_id, "", "", "")
        await link.js.publish(R.req_subject(daemon_id, spec.req_id), data, timeout=5.0)
    finally:
        await link.close()


def test_a_record_its_daemon_does_not_run_is_recovered_on_resume(
    nats_server: NatsServer,
) -> None:
    a = Daemon(nats_server.url, "own-a").start()
    b = Daemon(nats_server.url, "own-b").start()
    workers: list[Proc] = []
    try:
        workers.append(start_sim_worker(a.address, "own0"))
        wait_ready(a.address, ["own0"], 60.0)
        here, through_b = Spec("own-1", [21] * 24, MAX_TOKENS), Spec("own-2", [22] * 24, MAX_TOKENS)

        async def scenario() -> list[tuple[list[int], rpb.Finished | None]]:
            await _write_accepted(nats_server.url, "own-a", here)
            await _write_accepted(nats_server.url, "own-a", through_b)
            return [
                await resume_all(a.address, "own-1"),  # at its owner
                await resume_all(b.address, "own-2"),  # relayed to its owner by a peer
            ]

        results = asyncio.run(asyncio.wait_for(scenario(), 120))
        for spec, (tokens, fin) in zip((here, through_b), results, strict=True):
            assert fin is not None, f"{spec.req_id}: no Finished"
            assert fin.reason == common_pb2.FINISH_REASON_LENGTH, fin.message
            assert tokens == sim_expected(spec.req_id, 24, MAX_TOKENS), spec.req_id
    finally:
        for w in workers:
            w.stop()
        a.stop()
        b.stop()
