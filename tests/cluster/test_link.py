"""Joining a cluster: a real nats-server, a real daemon; unreachable NATS is a clear error."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.js.errors import KeyWrongLastSequenceError

from kvsched.cluster.link import connect_cluster
from kvsched.cluster.natsd import NatsServer, free_port
from kvsched.core.errors import Unavailable
from tests.integration.harness import Proc, start_daemon


def test_link_opens_buckets_with_compare_and_set(nats_server: NatsServer) -> None:
    async def go() -> None:
        link = await connect_cluster(nats_server.url, "d1")
        try:
            kv = await link.bucket(f"t-{uuid.uuid4().hex[:8]}")
            rev = await kv.create("lease", b"d1")
            with pytest.raises(KeyWrongLastSequenceError):
                await kv.update("lease", b"d2", last=rev + 7)  # a stale revision loses
            await kv.update("lease", b"d2", last=rev)
            assert (await kv.get("lease")).value == b"d2"
        finally:
            await link.close()

    asyncio.run(go())


def test_connect_to_nothing_names_the_url_and_the_fix() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(
        Unavailable, match=r"cannot reach NATS at nats://127\.0\.0\.1:\d+.*kvsched nats"
    ):
        asyncio.run(connect_cluster(url, "d1", connect_timeout_s=0.5, attempts=1))


def test_daemon_with_unreachable_cluster_fails_at_start() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = Proc(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--cluster", url])
    try:
        assert proc.wait(30) == 2
        proc.wait_for(r"kvsched: cannot reach NATS at " + url.replace(".", r"\."))
    finally:
        proc.stop()


def test_daemon_falls_back_to_standalone_when_configured() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc, _ = start_daemon("--cluster", url, "--cluster-fallback", "standalone")
    try:
        proc.wait_for(r"running standalone \(cluster_fallback = standalone\)")
        assert proc.popen.poll() is None
    finally:
        proc.stop()


def test_daemon_joins_a_real_cluster(nats_server: NatsServer) -> None:
    proc, _ = start_daemon("--cluster", nats_server.url, "--daemon-id", "alpha")
    try:
        proc.wait_for(r"joined cluster nats://127\.0\.0\.1:\d+ as daemon alpha")
    finally:
        proc.stop()
    assert proc.popen.returncode == 0, proc.output()
