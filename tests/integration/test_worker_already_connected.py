"""A worker whose hello is refused because its rank is still attached (the daemon has not yet
seen the rank's previous stream break: a partition, a pause) retries with backoff instead of
exiting, and attaches once the old stream is gone (issue 23: the nemesis suite saw workers exit
on FAILED_PRECONDITION "already connected")."""

from __future__ import annotations

from tests.integration.harness import start_daemon, start_worker, status, wait_ready


def test_a_second_rank_0_retries_with_backoff_and_attaches_when_the_first_leaves() -> None:
    daemon, address = start_daemon()
    first = start_worker(address, "i0")
    second = None
    try:
        wait_ready(address, ["i0"])
        fast = ("--reconnect-min-s", "0.05", "--reconnect-max-s", "0.3")
        second = start_worker(address, "i0", *fast)
        # Refused while the first is attached: two refusals, and it is still running.
        second.wait_for(r"already connected; retrying with backoff", timeout=60)
        line = second.wait_for(r"already connected; retrying with backoff").string
        second.wait_after(line, r"already connected; retrying with backoff", timeout=60)
        assert second.popen.poll() is None, second.output()
        assert "daemon refused worker" not in second.output()
        first.stop()  # the old stream goes: the second takes its place
        second.wait_for(r"welcomed by", timeout=60)
        wait_ready(address, ["i0"], 60.0)
        assert status(address, "i0").instances[0].num_ranks_connected == 1
    finally:
        if second is not None:
            second.stop()
        first.stop()
        daemon.stop()
