"""The front end's Session link coalesces a burst: the requests queued while its writer was
busy go out in one message (SessionRequest.batch), an abort queued among them keeps its place
(the run of submits before it is sent first), and every request still gets exactly its own
tokens. Real daemon and sim worker on loopback; the front end's Backend (what `kvsched http`
serves its routes with) runs in the test's event loop, so its link can be read."""

from __future__ import annotations

import asyncio

from kvsched.http.backend import Backend
from kvsched.http.session import RequestStream
from tests.integration.clients import expected_tokens
from tests.integration.harness import start_daemon, start_worker, wait_ready

PROMPT = [5, 6, 7, 8, 9, 10]
LONG = 100_000


async def _drain(stream: RequestStream) -> list[int]:
    """What an HTTP handler does with its request: read its batches to the end."""
    out: list[int] = []
    while (batch := await stream.next_batch()) is not None:
        out.extend(batch)
    return out


def _opts(rid: str, max_tokens: int) -> dict[str, object]:
    return {"request_id": rid, "max_tokens": max_tokens, "ignore_eos": True}


def test_a_burst_goes_out_in_batches_and_an_abort_among_it_keeps_its_place() -> None:
    daemon, address = start_daemon()
    worker = start_worker(address, "i0")

    async def main() -> None:
        backend = Backend([address])
        try:
            # The first request opens the link; its answer comes after the daemon's initial
            # metadata (which says it takes batches).
            warm = backend.submit(PROMPT, _opts("warm", 2), None)
            assert await _drain(warm) == expected_tokens("warm", len(PROMPT), 2, [])
            (link,) = backend._links.values()
            assert link.batched_submits == 0

            # 12 handlers start together (as concurrent HTTP requests do): each queues its
            # submit before the link's writer runs, which sends them in one message.
            ids = [f"h{i}" for i in range(12)]
            burst = [backend.submit(PROMPT, _opts(r, 3 + i % 4), None) for i, r in enumerate(ids)]
            got = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in burst)), 60)
            assert got == [
                expected_tokens(r, len(PROMPT), 3 + i % 4, []) for i, r in enumerate(ids)
            ]
            assert link.batched_submits == 12

            # Submits and an abort queued in one turn: 6 submits, the abort of the 6th (a long
            # one), 6 more. It reaches the daemon after its submit: the request is aborted
            # (sent before it, the abort would find nothing and the request run on).
            ids = [f"a{i}" for i in range(12)]
            streams = [
                backend.submit(PROMPT, _opts(r, LONG if i == 5 else 4), None)
                for i, r in enumerate(ids)
            ]
            for i, s in enumerate(streams):
                link.submit(s)
                if i == 5:
                    link.abort(s.request_id, stop=False)
            await asyncio.wait_for(asyncio.gather(*(s.wait_ended(60) for s in streams)), 70)
            reasons = [s.finished.reason if s.finished else None for s in streams]
            assert reasons == ["length"] * 5 + ["abort"] + ["length"] * 6
            for i, s in enumerate(streams):
                if i != 5:
                    assert s.tokens == expected_tokens(ids[i], len(PROMPT), 4, [])
            assert link.batched_submits == 24  # 12 before, then two runs of 6
        finally:
            await backend.close()

    try:
        wait_ready(address, ["i0"])
        asyncio.run(main())
    finally:
        worker.stop()
        daemon.stop()
