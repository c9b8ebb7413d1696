"""kvsched.storage's Mooncake client against a real master and segment holder: put / get /
exists, batches, a missing key and a master that is down as typed errors, URL parsing."""

from __future__ import annotations

import os

import pytest

from kvsched.core.errors import ConfigError
from kvsched.storage import (
    KeyMissing,
    MooncakeStore,
    StoreUnavailable,
    parse_url,
)
from kvsched.storage.server import MooncakeServer, free_port, parse_size


def test_url_parsing_names_master_and_metadata_server() -> None:
    a = parse_url("mooncake://10.0.0.5:50051?metadata=10.0.0.6:8081")
    assert (a.master, a.metadata_url) == ("10.0.0.5:50051", "http://10.0.0.6:8081/metadata")
    b = parse_url("mooncake://h:1")
    assert b.metadata_url == "http://h:8080/metadata"
    assert parse_url(a.url) == a
    for bad in ["nats://h:1", "mooncake://h", "mooncake://h:1?x=2", "mooncake://h:1?metadata=h"]:
        with pytest.raises(ConfigError):
            parse_url(bad)


def test_sizes() -> None:
    assert parse_size("1GB") == 1 << 30 and parse_size("512 MiB") == 512 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_put_get_exists_and_batches(mooncake: MooncakeServer) -> None:
    with MooncakeStore.connect(mooncake.url) as store:
        value = os.urandom(64 << 10)
        store.put("t/one", value)
        assert store.get("t/one") == value
        assert store.exists("t/one") and not store.exists("t/none")
        keys = [f"t/b{i}" for i in range(5)]
        values = [os.urandom(4096 + i) for i in range(5)]
        assert store.put_many(keys, values) == []
        assert store.get_many([*keys, "t/none"]) == [*values, None]
        assert store.exists_many(["t/b0", "t/none"]) == [True, False]
        # a second client (another worker) sees what the first stored
        with MooncakeStore.connect(mooncake.url) as other:
            assert other.get("t/b3") == values[3]


def test_a_key_asked_twice_in_one_batch_gets_its_own_bytes_each_time(
    mooncake: MooncakeServer,
) -> None:
    """Two requests sharing a prefix fetched in one step ask the same keys twice in one
    get_many: Mooncake's get_batch gave the earlier of two equal keys wrong bytes (8 KiB
    values), and a prefill/decode hand-off through the store decoded from garbage."""
    with MooncakeStore.connect(mooncake.url) as writer, MooncakeStore.connect(mooncake.url) as r:
        values = {f"dup-{i}": os.urandom(8 << 10) for i in range(4)}
        assert writer.put_many(list(values), list(values.values())) == []
        keys = ["dup-0", "dup-1", "dup-2", "dup-0", "dup-1", "dup-3"]
        assert r.get_many(keys) == [values[k] for k in keys]


def test_missing_key_is_a_typed_error(mooncake: MooncakeServer) -> None:
    with MooncakeStore.connect(mooncake.url) as store:
        with pytest.raises(KeyMissing, match="t/never"):
            store.get("t/never")
        store.put("t/gone", b"x" * 100)
        store.remove("t/gone")
        assert not store.exists("t/gone")
        with pytest.raises(KeyMissing):
            store.get("t/gone")
        with pytest.raises(KeyMissing):
            store.remove("t/gone")


def test_master_down_is_a_typed_error(fresh_mooncake: MooncakeServer) -> None:
    """(Each call to a dead master takes seconds: one read here; the worker tests cover writes.)"""
    store = MooncakeStore.connect(fresh_mooncake.url)
    store.put("t/k", b"v" * 1000)
    fresh_mooncake.kill_master()
    with pytest.raises(StoreUnavailable, match=r"does not answer|is down"):
        store.get("t/k")
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.get("t/k")


def test_connecting_to_no_master_is_a_typed_error() -> None:
    port = free_port()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        MooncakeStore.connect(f"mooncake://127.0.0.1:{port}?metadata=127.0.0.1:{free_port()}")


def test_hung_master_is_told_by_a_probe_not_by_the_client(fresh_mooncake: MooncakeServer) -> None:
    """A master that hangs (SIGSTOP: connections accepted, nothing answered): connecting
    raises StoreUnavailable naming its silent metadata server (the Mooncake client's setup
    would wait for it holding the GIL) and a connected client's healthy() is False; both
    answer again once the master goes on."""
    store = MooncakeStore.connect(fresh_mooncake.url)
    fresh_mooncake.pause_master()
    try:
        assert not store.healthy()
        with pytest.raises(StoreUnavailable, match=r"metadata server \S+ does not answer"):
            MooncakeStore.connect(fresh_mooncake.url)
    finally:
        fresh_mooncake.resume_master()
    assert store.healthy()
    store.close()
