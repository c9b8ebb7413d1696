"""The worker's side of the shared storage tier (protocol step 13): running the daemon's
storage_writes (right after swap_outs) and storage_fetches (after swap_ins, before chunks) at a
step boundary, and what the next report says about them.

Who moves the bytes:
- the `sim` executor holds no KV and needs no store: it prices each transfer by a block's
  bytes over its storage bandwidth (`storage_copied`) and every task succeeds;
- an executor with `storage_read(block_ids) -> [bytes]` and `storage_write(gpu_ids, blobs)`
  (the `model` and `vllm` executors) moves real block bytes through the store the Welcome names
  (`StoreLink`, a Mooncake Store client);
- any other executor fails every storage task (reported, never fatal).

Prefetches (storage -> host, for a request the daemon holds in its queue) run right after the
writes: keys into host blocks, failures by host block in failed_storage_prefetches.

A write that failed is reported by key in failed_storage_writes; a fetch that failed (key
evicted, store down, bytes of the wrong size) by handle in failed_storage_fetches, and that
handle runs nothing more until the daemon's preempt arrives (the request recomputes), like a
failed swap-in. A report after storage tasks ran is due even with no rows: its applied_seq
acknowledges them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvsched.core.protocol import StepReport, Tasks
from kvsched.storage.client import StoreUnavailable

log = logging.getLogger(__name__)

BACKENDS = ("mooncake",)  # the storage tiers a worker can reach (Hello.storage_backends)
_RETRY_S = 2.0  # a store found down: tasks fail at once, reconnects wait this long at first,
_MAX_RETRY_S = 30.0  # doubling up to this


class BlockStore(Protocol):
    """What the worker needs of a store (kvsched.storage.MooncakeStore)."""

    @property
    def url(self) -> str: ...

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


def _connect_mooncake(url: str) -> BlockStore:
    from kvsched.storage import MooncakeStore  # the storage extra: loaded only when used

    return MooncakeStore.connect(url)


def reachable_backends(executor_name: str) -> tuple[str, ...]:
    """Hello.storage_backends for a worker running this executor: the sim simulates the
    store; the model and vllm executors need the Mooncake client installed; others reach
    none."""
    if executor_name == "sim":
        return BACKENDS
    if executor_name in ("model", "vllm"):
        from kvsched.storage import mooncake_available

        if mooncake_available():
            return BACKENDS
        log.warning("no storage tier: the Mooncake client is not installed (kvsched[storage])")
    return ()


class StoreLink:
    """The worker's connection to the store Welcome.storage_url names, kept across sessions
    while the URL stays the same. `use` connects at once (a session's start, in a thread).
    While the store cannot be used `get` answers None at once (the task fails) and a
    background thread looks again, at most every _RETRY_S doubling to _MAX_RETRY_S: it
    connects (a store never reached) or asks the client it has whether the master answers
    again (a store found down: `down`). A client is never closed for an outage: the
    Mooncake client's close (and its setup against a master that is down) holds the GIL for
    seconds, which would stop the worker's heartbeats; the same client serves a restarted
    master. So a store that is down costs the step loop at most the one call that found it
    down (bounded: kvsched.storage.client), never the stream."""

    def __init__(self, connect: Callable[[str], BlockStore] = _connect_mooncake) -> None:
        self._connect = connect
        self.url = ""  # "": no storage tier this session
        self.store: BlockStore | None = None
        self.is_down = False  # the store was found down: tasks fail until it answers again
        self._retry_at = 0.0  # no reconnect / re-check before this monotonic time
        self._retry_s = _RETRY_S
        self._connecting = False  # a background connect or re-check runs
        self.num_connect_failures = 0
        self.num_outages = 0  # times an operation found the store down
        self._lock = threading.RLock()

    def use(self, url: str) -> None:
        """The Welcome named this store ("" = none): connect now if it is a new one. A store
        that cannot be reached is logged at ERROR and every storage task then fails until a
        reconnect succeeds."""
        with self._lock:
            if url == self.url and (self.store is not None or not url):
                return
            self.close()
            self.url = url
            self.is_down = False
            self._retry_s = _RETRY_S
        if url:
            self._attempt(url)

    def get(self) -> BlockStore | None:
        """The connected store; None (tasks fail) while it cannot be reached or is down."""
        with self._lock:
            if not self.url or (self.store is not None and not self.is_down):
                return self.store
            if not self._connecting and time.monotonic() >= self._retry_at:
                self._connecting = True
                look = self._recheck if self.store is not None else self._attempt
                threading.Thread(
                    target=look, args=(self.url,), name="kvsched-store", daemon=True
                ).start()
            return None

    def _attempt(self, url: str) -> None:
        try:
            store = self._connect(url)
        except Exception as e:
            self._not_yet(connect_failed=True)
            log.error(
                "storage tier: cannot connect to %s (%s): every storage task fails "
                "(fetches recompute) until it can",
                url,
                e,
            )
            return
        with self._lock:
            self._connecting = False
            keep = url == self.url and self.store is None
            if keep:
                self.store = store
                self.is_down = False
                self._retry_s = _RETRY_S
        if keep:
            log.info("storage tier: connected to %s", url)
        else:  # the Welcome named another store meanwhile
            store.close()

    def _recheck(self, url: str) -> None:
        """Whether the store found down answers again (its client kept)."""
        with self._lock:
            store = self.store
        try:
            up = store is not None and store.healthy()
        except Exception:
            up = False
        if not up:
            self._not_yet()
            return
        with self._lock:
            self._connecting = False
            if store is self.store and url == self.url:
                self.is_down = False
                self._retry_s = _RETRY_S
        log.info("storage tier: %s answers again", url)

    def _not_yet(self, connect_failed: bool = False) -> None:
        """A connect or re-check failed: the next one waits longer."""
        with self._lock:
            self.num_connect_failures += connect_failed
            self._connecting = False
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(2 * self._retry_s, _MAX_RETRY_S)

    def down(self) -> None:
        """An operation found the store unreachable: tasks fail at once until a re-check
        (after _RETRY_S, doubling) finds its master answering again."""
        with self._lock:
            if not self.is_down:
                self.num_outages += 1
            self.is_down = True
            self._retry_at = time.monotonic() + self._retry_s

    def close(self) -> None:
        """Drop the client (the Welcome named another store): its close holds the
        GIL for up to seconds, so call it off the step loop and not per outage."""
        with self._lock:
            store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                log.warning("storage tier: closing %s failed", self.url, exc_info=True)


class StorageTasks:
    """Runs one engine's storage tasks on its executor and keeps what the next report must
    say about them. `link` (set by the step loop each session) is the store to use."""

    def __init__(self, executor: Any, link: StoreLink | None = None) -> None:
        self.executor = executor
        self.link = link
        self.key_suffix = ""  # ranks of a multi-rank instance store their own shards
        self.failed_writes: list[str] = []
        self.failed_fetches: dict[int, None] = {}
        self.failed_prefetches: list[int] = []  # host blocks
        self.ran = False  # storage tasks ran since the last report
        self.num_written = 0  # blocks written, fetched (into blocks of a handle that runs)
        self.num_fetched = 0
        # Wall seconds of real writes and fetches (store I/O and the executor's cache copies),
        # taken by the worker's stats after each step (the P/D hand-off's cost, bench/).
        self.write_s = 0.0
        self.fetch_s = 0.0
        self.num_prefetched = 0  # blocks got into host blocks (storage -> host prefetch)
        self.fetched_ahead: dict[int, int] = {}  # handle -> blocks fetched ahead, this boundary

    @property
    def simulated(self) -> bool:
        return hasattr(self.executor, "storage_copied")

    def blocking(self, tasks: Tasks) -> bool:
        """Whether applying these tasks does store I/O (run it off the event loop)."""
        real = not self.simulated and self.link is not None and bool(self.link.url)
        return real and bool(
            tasks.storage_write_keys or tasks.storage_fetch_keys or tasks.storage_prefetch_keys
        )

    def write_all(self, tasks: Tasks) -> None:
        if tasks.storage_write_keys:
            self.write(tasks.storage_write_keys, tasks.storage_write_blocks)

    def fetch_all(self, tasks: Tasks, ahead: set[int] | None = None) -> list[int]:
        """`ahead`: handles with no chunk in this message (HostCopies.swap_in): fetched as
        any, then the sim prices theirs beside the next step (`fetched_ahead`: blocks by
        handle, until a chunk at the same boundary reads them, `ahead_read`, or it runs)."""
        if not tasks.storage_fetch_keys:
            return []
        t = tasks
        failed = self.fetch(t.storage_fetch_handles, t.storage_fetch_keys, t.storage_fetch_gpu)
        if ahead and self.simulated and hasattr(self.executor, "copies_ahead"):
            n = 0
            for h in t.storage_fetch_handles:
                if h in ahead:
                    self.fetched_ahead[h] = self.fetched_ahead.get(h, 0) + 1
                    n += 1
            if n:
                self.executor.copies_ahead(0, n)
        return failed

    def ahead_read(self, handle: int) -> None:
        """A chunk at this boundary reads `handle`'s fetches sent ahead: before the step."""
        n = self.fetched_ahead.pop(handle, 0)
        if n:
            self.executor.copies_read(0, n)

    def prefetch_all(self, tasks: Tasks) -> None:
        if tasks.storage_prefetch_keys:
            self.prefetch(tasks.storage_prefetch_keys, tasks.storage_prefetch_host)

    def prefetch(self, keys: list[str], host_ids: list[int]) -> None:
        """Get each key into its host block (a request waiting in the daemon's queue; core/
        prefetch.py); failures are reported by host block. The sim prices it beside the step
        (the NIC writes host memory while the GPU computes), as a write."""
        self.ran = True
        if self.simulated:
            ex = self.executor
            if hasattr(ex, "storage_prefetched"):
                ex.storage_prefetched(len(keys))
            else:
                ex.storage_copied(len(keys), write=True)
            self.num_prefetched += len(keys)
            return
        store = self._store()
        put = getattr(self.executor, "storage_write_host", None)
        if store is None or put is None:
            self.failed_prefetches.extend(host_ids)
            return
        try:
            blobs = store.get_many([k + self.key_suffix for k in keys])
        except Exception as e:
            self._failed("prefetch", len(keys), e)
            self.failed_prefetches.extend(host_ids)
            return
        good = [i for i, b in enumerate(blobs) if b is not None]
        bad = [host_ids[i] for i, b in enumerate(blobs) if b is None]
        if good:
            try:
                put([host_ids[i] for i in good], [blobs[i] for i in good])
                self.num_prefetched += len(good)
            except Exception as e:
                log.warning("storage prefetch of %d blocks failed: %s", len(good), e)
                bad.extend(host_ids[i] for i in good)
        self.failed_prefetches.extend(bad)

    def write(self, keys: list[str], block_ids: list[int]) -> None:
        """Put each block (a host block when the executor has a host tier, else a GPU block)
        under its key; failures are reported by key."""
        self.ran = True
        if self.simulated:
            self.executor.storage_copied(len(keys), write=True)
            self.num_written += len(keys)
            return
        store = self._store()
        read = getattr(self.executor, "storage_read", None)
        if store is None or read is None:
            self.failed_writes.extend(keys)
            return
        started = time.perf_counter()
        try:
            blobs = read(block_ids)
            failed = store.put_many([k + self.key_suffix for k in keys], blobs)
        except Exception as e:
            self._failed("write", len(keys), e)
            self.failed_writes.extend(keys)
            return
        finally:
            self.write_s += time.perf_counter() - started
        if failed:
            n = len(self.key_suffix)
            self.failed_writes.extend(k[: len(k) - n] if n else k for k in failed)
        self.num_written += len(keys) - len(failed)

    def fetch(self, handles: list[int], keys: list[str], gpu_ids: list[int]) -> list[int]:
        """Get each key into its GPU block; a handle's fetches are one run. Returns the
        handles whose fetch failed (nothing of a failed handle's run is trusted)."""
        self.ran = True
        runs = _runs(handles)
        if self.simulated:
            self.executor.storage_copied(len(keys), write=False)
            self.num_fetched += len(keys)
            return []
        started = time.perf_counter()
        try:
            return self._fetch(handles, keys, gpu_ids, runs)
        finally:
            self.fetch_s += time.perf_counter() - started

    def _fetch(
        self, handles: list[int], keys: list[str], gpu_ids: list[int], runs: list[tuple[int, int]]
    ) -> list[int]:
        store = self._store()
        write = getattr(self.executor, "storage_write", None)
        blobs: list[bytes | None] = [None] * len(keys)
        why = "the store is down or not connected" if store is None else ""
        if store is not None and write is not None:
            try:
                blobs = store.get_many([k + self.key_suffix for k in keys])
            except Exception as e:
                self._failed("fetch", len(keys), e)
                why = str(e)
        failed: list[int] = []
        for i, j in runs:
            got = blobs[i:j]
            try:
                if write is None or any(b is None for b in got):
                    missing = f"{sum(b is None for b in got)} of {j - i} keys missing"
                    raise LookupError(f"{missing} ({why})" if why else missing)
                write(gpu_ids[i:j], got)
                self.num_fetched += j - i
            except Exception as e:
                log.warning("storage fetch for handle %d failed: %s", handles[i], e)
                self.failed_fetches[handles[i]] = None
                failed.append(handles[i])
        return failed

    def _store(self) -> BlockStore | None:
        return self.link.get() if self.link is not None else None

    def _failed(self, what: str, n: int, e: Exception) -> None:
        """A store that is down is not asked again for a while (its calls take seconds)."""
        if isinstance(e, StoreUnavailable) and self.link is not None:
            log.error("storage tier: %s; storage tasks fail until it answers again", e)
            self.link.down()
        else:
            log.warning("storage %s of %d blocks failed: %s", what, n, e)

    @property
    def pending(self) -> bool:
        return self.ran

    def fill(self, report: StepReport) -> None:
        """Put the failures into the report; the tasks are acknowledged by it."""
        if self.ran:
            report.failed_storage_writes, self.failed_writes = self.failed_writes, []
            report.failed_storage_fetches = list(self.failed_fetches)
            self.failed_fetches.clear()
            report.failed_storage_prefetches, self.failed_prefetches = self.failed_prefetches, []
            self.ran = False


def _runs(handles: list[int]) -> list[tuple[int, int]]:
    """[i, j) ranges of equal consecutive handles."""
    out: list[tuple[int, int]] = []
    i, n = 0, len(handles)
    while i < n:
        j = i
        while j < n and handles[j] == handles[i]:
            j += 1
        out.append((i, j))
        i = j
    return out
