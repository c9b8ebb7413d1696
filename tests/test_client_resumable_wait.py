"""The resumable client's bounded waits against a real daemon process that is paused (SIGSTOP):
its kernel still accepts TCP, so neither the open stream nor a new call fails by itself.

- a Resume and a Generate sent over an established connection to the stopped daemon get no
  first answer: each raises NoAnswer after its `first_answer_timeout` (the call cancelled)
  instead of waiting for SIGCONT;
- the open resumable stream, silent since its worker was stopped 6 s before (more than the
  keepalive interval: no token, no flow-control ping), is abandoned while the daemon is still
  stopped (gRPC keepalive: the paused daemon answers no ping), and its Resume attempts keep
  ending (none waits for the daemon) while it stays stopped;
- after SIGCONT the stream resumes with the tokens it holds and ends with exactly the sim's
  tokens (none lost, none twice).

One daemon (no cluster): the only daemon to try next is the same one. Loopback only; every
wait is bounded; nothing asserts on wall-clock time."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kvsched.client import AsyncClient, NoAnswer
from kvsched.client.resumable import resumable, resumable_channel_options
from kvsched.client.types import Finished
from tests.cluster.durability_kit import sim_expected
from tests.integration.harness import start_daemon, start_worker, wait_pool_free, wait_ready

pytestmark = pytest.mark.faults  # a fault scenario: `make test-faults` (a CI step)

ATTEMPT_S = 0.5


def test_paused_daemon_stream_and_attempts_are_abandoned_then_resume_exact() -> None:
    daemon, address = start_daemon(env={"KVSCHED_HEARTBEAT_TIMEOUT_S": "120"})
    worker = start_worker(address, "rw0", "--speed", "0.3")
    try:
        wait_ready(address, ["rw0"], 60.0)
        prompt = list(range(5, 45))
        seen: dict[str, float] = {}

        async def run() -> tuple[list[int], Finished | None, int, int]:
            opts = resumable_channel_options(keepalive_s=5.0, ping_timeout_s=1.0)
            async with AsyncClient(address, options=opts) as client:
                stream = resumable(
                    client,
                    prompt,
                    request_id="rw-1",
                    max_tokens=300,
                    detachable=True,
                    attempt_timeout_s=ATTEMPT_S,
                    retry_for_s=120,
                )
                task = asyncio.create_task(stream.read_all())
                other = AsyncClient(address)  # plain channel: no keepalive, default options
                assert await other.list_models(timeout=10)  # connected before the pause
                deadline = time.monotonic() + 60
                while len(stream.tokens) < 5:
                    assert time.monotonic() < deadline, "no tokens before the pause"
                    assert not task.done(), "the stream ended before the pause"
                    await asyncio.sleep(0.02)
                worker.signal(signal.SIGSTOP)  # the stream goes silent, the daemon lives
                await asyncio.sleep(6.0)
                assert not stream.broken_at, "a live daemon's silent stream was broken"
                daemon.signal(signal.SIGSTOP)
                try:
                    held = len(stream.tokens)
                    paused = time.monotonic()
                    for call in (
                        other.resume("rw-unknown", [], first_answer_timeout=ATTEMPT_S),
                        other.generate(prompt, request_id="rw-2", first_answer_timeout=ATTEMPT_S),
                    ):
                        try:
                            await asyncio.wait_for(call, 30)  # bounded if the bound is broken
                            raise AssertionError("a stopped daemon answered")
                        except NoAnswer as exc:
                            assert "within 0.5 s" in str(exc), exc
                    # Bounded: the stream must break and its attempts keep ending while the
                    # daemon is stopped (without the bounds this waits out the whole loop).
                    while not stream.broken_at or stream.attempts < 4:
                        assert time.monotonic() - paused < 40, (
                            f"still waiting on the paused daemon: breaks {stream.broken_at}, "
                            f"attempts {stream.attempts}, last error {stream.last_error!r}"
                        )
                        assert not task.done(), "the stream ended while the daemon was stopped"
                        await asyncio.sleep(0.05)
                    seen["stall"] = time.monotonic() - paused
                    seen["break"] = stream.broken_at[0] - paused
                    broke, attempts = len(stream.broken_at), stream.attempts
                    assert len(stream.tokens) == held  # nothing came from a stopped daemon
                finally:
                    daemon.signal(signal.SIGCONT)
                    worker.signal(signal.SIGCONT)
                tokens = await asyncio.wait_for(task, 120)
                await other.close()
                return tokens, stream.finished, broke, attempts

        tokens, finished, broke, attempts = asyncio.run(asyncio.wait_for(run(), 240))
        assert broke == 1  # one break, followed by attempts, until it resumed
        assert tokens == sim_expected("rw-1", len(prompt), 300)
        assert finished is not None and finished.reason == "length", finished
        wait_pool_free(address)
        print(
            f"\nSIGSTOP -> silent stream abandoned {seen['break']:.2f} s (keepalive 5 s, ping "
            f"timeout 1 s; two NoAnswer calls of {ATTEMPT_S:g} s first); {attempts} attempts "
            f"ended by {seen['stall']:.2f} s while stopped; exact after SIGCONT"
        )
    except BaseException:
        print("---- daemon\n" + "\n".join(daemon.output().splitlines()[-60:]))
        raise
    finally:
        worker.stop()
        daemon.stop()


def test_silent_stream_of_a_live_daemon_is_not_abandoned() -> None:
    """A stream that gets no token for 12 s (2.4 keepalive intervals) (its worker stopped, the
    daemon alive) is kept: the daemon answers the pings (and accepts their rate: no
    "too_many_pings"), so no break and no resume; the tokens continue afterwards, exact."""
    daemon, address = start_daemon(env={"KVSCHED_HEARTBEAT_TIMEOUT_S": "120"})
    worker = start_worker(address, "rw1", "--speed", "0.3")
    try:
        wait_ready(address, ["rw1"], 60.0)
        prompt = list(range(7, 37))

        async def run() -> tuple[list[int], int, int]:
            opts = resumable_channel_options(keepalive_s=5.0, ping_timeout_s=1.0)
            async with AsyncClient(address, options=opts) as client:
                stream = resumable(
                    client, prompt, request_id="rw-3", max_tokens=200, attempt_timeout_s=ATTEMPT_S
                )
                task = asyncio.create_task(stream.read_all())
                deadline = time.monotonic() + 60
                while len(stream.tokens) < 5:
                    assert time.monotonic() < deadline, "no tokens before the worker stopped"
                    assert not task.done(), "the stream ended before the worker stopped"
                    await asyncio.sleep(0.02)
                worker.signal(signal.SIGSTOP)
                try:
                    held = len(stream.tokens)
                    await asyncio.sleep(12.0)  # over 2 keepalive intervals without a token
                    silent = len(stream.tokens) == held
                finally:
                    worker.signal(signal.SIGCONT)
                assert silent, "tokens came while the only worker was stopped"
                tokens = await asyncio.wait_for(task, 120)
                return tokens, len(stream.broken_at), stream.attempts

        tokens, breaks, attempts = asyncio.run(asyncio.wait_for(run(), 240))
        assert (breaks, attempts) == (0, 1), (breaks, attempts)
        assert tokens == sim_expected("rw-3", len(prompt), 200)
        assert "too_many_pings" not in daemon.output()
    except BaseException:
        print("---- daemon\n" + "\n".join(daemon.output().splitlines()[-60:]))
        raise
    finally:
        worker.stop()
        daemon.stop()
