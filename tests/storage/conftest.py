"""A real Mooncake Store (master + one segment holder) on free loopback ports for the storage
tests; skipped where the storage extra is not installed (`.ci/run` installs it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsched.storage import mooncake_available
from kvsched.storage.server import MooncakeServer

needs_mooncake = pytest.mark.skipif(
    not mooncake_available(), reason="the storage extra (Mooncake client) is not installed"
)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeServer]:
    """One store per test module (starting one takes ~1 s); tests use distinct keys."""
    if not mooncake_available():
        pytest.skip("the storage extra (Mooncake client) is not installed")
    with MooncakeServer(capacity_bytes=256 << 20) as server:
        yield server


@pytest.fixture
def fresh_mooncake() -> Iterator[MooncakeServer]:
    """A store of the test's own, for tests that kill its master."""
    if not mooncake_available():
        pytest.skip("the storage extra (Mooncake client) is not installed")
    with MooncakeServer(capacity_bytes=64 << 20) as server:
        yield server
