"""A thin client over Mooncake Store (the `mooncake-transfer-engine-non-cuda` wheel, the `storage`
extra): put and get of KV blocks' bytes under string keys, existence checks, typed errors.

It speaks TCP to the store's master and reads the transfer engine's metadata from the master's
built-in HTTP metadata server. The store's capacity is the memory its segment holders mount
(`kvsched mooncake` runs one); this client mounts none by default, so a worker's exit loses
nothing. The store owns eviction: a key put earlier may be gone at any time.

URL form: ``mooncake://HOST:PORT[?metadata=HOST:PORT]``: the master's RPC address, and its HTTP
metadata server (default the master's host, port 8080, Mooncake's default).

The C++ client's `setup` and `close` hold Python's GIL for their whole run (measured with
wheel 0.3.13: `setup` 4.4 s against a master that is down, 30 s against one that hangs; `close`
up to 10 s): every thread of the process stands still meanwhile, a worker's heartbeats
included. So `setup` is only called once the master and the metadata server answer a plain
probe (`unreachable`, GIL-free sockets), and callers keep a client across a master's outage
instead of closing it (it serves a restarted master again). Its other calls release the GIL;
each of them is bounded by MC_RPC_TIMEOUT_MS (set below; Mooncake's default is 30 s).
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvsched.core.errors import ConfigError, KvschedError

log = logging.getLogger(__name__)

SCHEME = "mooncake"
DEFAULT_METADATA_PORT = 8080
# Bytes per put_batch / get_batch call (at least one value): larger batches of MiB values ran
# slower than one call per value here (bench/storage_io.py), smaller values gain from batching.
_BATCH_BYTES = 4 << 20
# Fail fast when the master is down or hangs: one try at setup; every RPC to the master bounded
# (a hung master otherwise holds each call 30 s, and a worker's storage thread with it).
_CLIENT_ENV = {
    "MC_RPC_CONNECT_TIMEOUT_MS": "1000",
    "MC_RPC_TIMEOUT_MS": "3000",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
}
_PROBE_TIMEOUT_S = 1.0  # `unreachable`: each socket connect / HTTP answer waits at most this
_PROBE_KEY = "kvsched/probe"  # asked for to tell a missing key from a master that is down
_INSTALL = (
    "the Mooncake client is not installed: `pip install 'kvsched[storage]'` (the "
    "mooncake-transfer-engine-non-cuda wheel; on Debian it needs "
    "`apt-get install libibverbs1 librdmacm1 libnuma1`)"
)


class StorageError(KvschedError):
    """A storage tier operation failed; the message says which and why."""


class StoreUnavailable(StorageError):
    """The store cannot be reached (master down, not started, wrong address) or the client
    is not installed or closed."""


class KeyMissing(StorageError, KeyError):
    """The store does not hold this key (never put, or evicted by the store)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "key not in the store"


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a Mooncake Store is: its master's RPC address and its HTTP metadata server."""

    host: str
    port: int
    metadata_host: str
    metadata_port: int

    @property
    def url(self) -> str:
        return (
            f"{SCHEME}://{self.host}:{self.port}?metadata={self.metadata_host}:{self.metadata_port}"
        )

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.metadata_host}:{self.metadata_port}/metadata"


def parse_url(url: str) -> StoreAddress:
    """`mooncake://HOST:PORT[?metadata=HOST:PORT]` as a StoreAddress; ConfigError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError(
            f"storage URL must look like mooncake://HOST:PORT[?metadata=HOST:PORT], got {url!r}"
        )
    try:
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"storage URL {url!r}: bad port ({e})") from e
    if port is None:
        raise ConfigError(f"storage URL {url!r}: give the master's port (mooncake://HOST:PORT)")
    query = parse_qs(parts.query)
    unknown = set(query) - {"metadata"}
    if unknown:
        raise ConfigError(f"storage URL {url!r}: unknown parameters {sorted(unknown)}")
    meta_host, meta_port = parts.hostname, DEFAULT_METADATA_PORT
    if "metadata" in query:
        value = query["metadata"][-1]
        host, _, port_text = value.rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"storage URL {url!r}: metadata must be HOST:PORT, got {value!r}")
        meta_host, meta_port = host, int(port_text)
    return StoreAddress(parts.hostname, port, meta_host, meta_port)


def unreachable(address: StoreAddress, timeout_s: float = _PROBE_TIMEOUT_S) -> str | None:
    """Why the store at `address` cannot be used now (None: its master accepts a TCP
    connection and its metadata server answers HTTP), found with plain sockets: no Mooncake
    call, no GIL held while waiting. A master that crashed refuses at once; one that hangs
    (stopped, overloaded) leaves its metadata server silent for timeout_s."""
    try:
        socket.create_connection((address.host, address.port), timeout_s).close()
    except OSError as e:
        return f"its master at {address.master} does not accept connections ({e})"
    conn = http.client.HTTPConnection(address.metadata_host, address.metadata_port, timeout_s)
    try:
        conn.request("GET", f"/metadata?key={_PROBE_KEY.replace('/', '%2F')}")
        conn.getresponse().read()  # any status: the server answers (404: no such key)
    except (OSError, http.client.HTTPException) as e:
        return f"its metadata server {address.metadata_url} does not answer ({e})"
    finally:
        conn.close()
    return None


def mooncake_available() -> bool:
    """Whether the Mooncake client imports here (the `storage` extra and its system libs)."""
    try:
        _store_class()
    except StoreUnavailable:
        return False
    return True


def _store_class() -> Any:
    os.environ.setdefault("GLOG_minloglevel", "2")  # glog's name: INFO logs otherwise
    for var, value in _CLIENT_ENV.items():  # fail fast when the master is down
        os.environ.setdefault(var, value)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # the wheel, or a system library it links (libibverbs ...)
        raise StoreUnavailable(f"{_INSTALL}: {e}") from e
    return MooncakeDistributedStore


class MooncakeStore:
    """One connection to a Mooncake Store. Thread-safe (the C++ client is; `close` is guarded).

    Blocking calls: run them off an event loop's thread. Connecting and `close` hold the GIL
    while they run (see the module's docstring): a long-lived process connects once and
    closes at its end.
    """

    def __init__(
        self,
        address: StoreAddress,
        *,
        local_host: str = "127.0.0.1",
        segment_bytes: int = 0,
        buffer_bytes: int = 64 << 20,
    ) -> None:
        """Connect now; StoreUnavailable when the master cannot be reached. segment_bytes:
        memory this client lends the store (0: none, only the holders' memory is used);
        buffer_bytes: the client's transfer buffer (a batch larger than it is split)."""
        if segment_bytes < 0 or buffer_bytes <= 0:
            raise ConfigError(
                f"need segment_bytes >= 0 and buffer_bytes > 0, got {segment_bytes}, {buffer_bytes}"
            )
        self.address = address
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._value_bytes = 0  # the largest value of the last get_many / put_many
        store_class = _store_class()
        # setup() holds the GIL until it gives up (seconds): ask with a plain probe first.
        if (why := unreachable(address)) is not None:
            raise StoreUnavailable(
                f"cannot connect to the Mooncake master at {address.master} (metadata "
                f"{address.metadata_url}): {why}; is `kvsched mooncake` (or mooncake_master "
                "with --enable_http_metadata_server) running there?"
            )
        self._store: Any = store_class()
        rc = self._store.setup(
            local_host,
            address.metadata_url,
            segment_bytes,
            buffer_bytes,
            "tcp",
            "",
            address.master,
        )
        if rc != 0:
            self._store = None
            raise StoreUnavailable(
                f"cannot connect to the Mooncake master at {address.master} (metadata "
                f"{address.metadata_url}): setup returned {rc}; is `kvsched mooncake` (or "
                "mooncake_master with --enable_http_metadata_server) running there?"
            )

    @classmethod
    def connect(cls, url: str, **kwargs: Any) -> MooncakeStore:
        return cls(parse_url(url), **kwargs)

    @property
    def url(self) -> str:
        return self.address.url

    def _client(self) -> Any:
        store = self._store
        if store is None:
            raise StoreUnavailable(f"the connection to {self.address.url} is closed")
        return store

    # ---- writes ---------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        """Store value under key (an existing key keeps its value: equal keys, equal
        blocks). StorageError when the store refused or cannot be reached."""
        rc = self._client().put(key, value)
        if rc != 0:
            raise self._error(f"put {key!r} ({len(value)} bytes)", rc)

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]:
        """Store values[i] under keys[i]; returns the keys that failed (empty: all stored).
        One batch per transfer buffer's worth; a failed batch is retried key by key to name
        the failures. StoreUnavailable when the master does not answer."""
        if len(keys) != len(values):
            raise ValueError(f"put_many: {len(keys)} keys but {len(values)} values")
        failed: list[str] = []
        self._value_bytes = max((len(v) for v in values), default=self._value_bytes)
        for lo, hi in self._batches(values):
            ks, vs = list(keys[lo:hi]), list(values[lo:hi])
            rc = self._client().put_batch(ks, vs)
            if rc == 0:
                continue
            if not self.healthy():
                raise StoreUnavailable(
                    f"put of {len(keys)} keys: the master at {self.address.master} does not "
                    f"answer (code {rc})"
                )
            for k, v in zip(ks, vs, strict=True):
                try:
                    self.put(k, v)
                except StorageError:
                    failed.append(k)
        return failed

    # ---- reads ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The value under key; KeyMissing when the store does not hold it, StoreUnavailable
        when the store cannot be reached."""
        value = bytes(self._client().get(key))
        if not value:
            raise self._missing(key)
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values under keys, in order; None where a key is missing (never put, or
        evicted). StoreUnavailable when the master does not answer. A key asked twice is got
        once: the client's get_batch returns wrong bytes for the earlier of two equal keys in
        one batch (seen with 8 KiB values; two requests with one prefix fetched in one step)."""
        unique = list(dict.fromkeys(keys))
        got: list[bytes | None] = []
        per_call = max(1, _BATCH_BYTES // max(1, self._value_bytes))  # sizes as last seen
        for lo in range(0, len(unique), per_call):
            values = self._client().get_batch(unique[lo : lo + per_call])
            got.extend(bytes(v) or None for v in values)
        by_key = dict(zip(unique, got, strict=True))
        out = [by_key[k] for k in keys]
        self._value_bytes = max((len(v) for v in got if v), default=self._value_bytes)
        if None in out and not self.healthy():
            raise StoreUnavailable(
                f"get of {len(keys)} keys: the master at {self.address.master} does not answer"
            )
        return out

    def exists(self, key: str) -> bool:
        """Whether the store holds key now; StoreUnavailable when it cannot be asked."""
        rc: int = self._client().is_exist(key)
        if rc < 0:
            raise self._error(f"is_exist {key!r}", rc)
        return rc == 1

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        rcs = self._client().batch_is_exist(list(keys))
        if any(rc < 0 for rc in rcs):
            raise self._error(f"batch_is_exist of {len(keys)} keys", min(rcs))
        return [rc == 1 for rc in rcs]

    def remove(self, key: str) -> None:
        """Drop key now (its lease ignored); KeyMissing when the store does not hold it."""
        if not self.exists(key):
            raise self._missing(key)
        rc = self._client().remove(key, True)
        if rc != 0:
            raise self._error(f"remove {key!r}", rc)

    def healthy(self) -> bool:
        """Whether the master answers now: a socket probe (`unreachable`: a crashed master
        is told at once), then an existence query (the client's own health check reports a
        master that just died as healthy). At most about 2 s + MC_RPC_TIMEOUT_MS."""
        store = self._store
        if store is None or unreachable(self.address) is not None:
            return False
        return bool(store.is_exist(_PROBE_KEY) >= 0)

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers --------------------------------------------------------------------------
    def _batches(self, values: Sequence[bytes]) -> list[tuple[int, int]]:
        """[lo, hi) runs whose bytes fit the transfer buffer (at least one value each)."""
        runs: list[tuple[int, int]] = []
        lo, size = 0, 0
        for i, v in enumerate(values):
            n = len(v)
            if i > lo and size + n > min(_BATCH_BYTES, self.buffer_bytes // 2):
                runs.append((lo, i))
                lo, size = i, 0
            size += n
        if lo < len(values):
            runs.append((lo, len(values)))
        return runs

    def _missing(self, key: str) -> StorageError:
        self._client()  # closed: StoreUnavailable
        if not self.healthy():
            return StoreUnavailable(f"get {key!r}: the master at {self.address.master} is down")
        return KeyMissing(f"key {key!r} is not in the store at {self.address.url}")

    def _error(self, what: str, rc: int) -> StorageError:
        if not self.healthy():
            return StoreUnavailable(
                f"{what}: the master at {self.address.master} does not answer (code {rc})"
            )
        return StorageError(f"{what}: Mooncake Store error code {rc}")
