"""A real nats-server with JetStream on a loopback port, one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsched.cluster.natsd import NatsServer


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server
