"""Storage -> host prefetch with every part its own process (docs/STORAGE.md, "Prefetch"):
`kvsched serve --storage URL`, `kvsched worker` processes and a real Mooncake Store. One
instance computes a prefix and writes its blocks (write_through) and leaves; a request with
that prefix then waits on another instance while its storage hits come into that worker's host
tier, and is placed with them as host hits (swap-ins): no storage fetch on a step.

- the model executor, the daemon prefetching at arrival and holding a request until its
  prefetch lands (`storage_prefetch_at_arrival`, `storage_prefetch_hold_ms`): the real bytes go store -> host block -> GPU block, and the
  tokens equal `generate_reference` (the model, unpaged);
- sim workers with prefetch on and otherwise default (the queue's head prefetched): the request
  waits behind another that holds the instance's only slot, and is prefetched meanwhile."""

from __future__ import annotations

import threading

import numpy as np

from kvsched.storage.server import MooncakeServer
from kvsched.worker_stub.model import ModelConfig, generate_reference
from tests.e2e.test_storage_processes import MODEL, _generate, _wait
from tests.integration.harness import start_daemon, start_worker, status, wait_ready
from tests.storage.conftest import mooncake  # noqa: F401 (fixture)

BS = 16


def _share(
    address: str, prompts: tuple[list[int], list[int]], worker_args: tuple[str, ...]
) -> None:
    """i0 computes prompts[0] (its prefix written through to the store) and leaves."""
    w0 = start_worker(address, "i0", *worker_args)
    try:
        wait_ready(address, ["i0"])
        _generate(address, "writer", prompts[0], 2)
        _wait(
            lambda: status(address, "i0").instances[0].num_storage_writes >= 4,
            "i0's prefix blocks written",
        )
        # The writes count once a report acknowledges them: a request served after them
        # finishes only after the reports that follow them.
        _generate(address, "flush", [3, 4, 5], 2)
    finally:
        w0.stop()


def test_model_worker_takes_a_prefetched_prefix_as_host_hits(mooncake: MooncakeServer) -> None:  # noqa: F811
    config = ModelConfig()
    rng = np.random.default_rng(3707)
    prefix = rng.integers(2, config.vocab_size, size=4 * BS).tolist()
    first = prefix + rng.integers(2, config.vocab_size, size=3).tolist()
    second = prefix + rng.integers(2, config.vocab_size, size=9).tolist()
    daemon, address = start_daemon(
        "--storage",
        mooncake.url,
        "--storage-write-policy",
        "write_through",
        env={
            "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH": "true",
            "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH_AT_ARRIVAL": "true",
            "KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH_HOLD_MS": "20000",
        },
    )
    w1 = None
    try:
        _share(address, (first, second), MODEL)
        w1 = start_worker(address, "i1", *MODEL, "--host-blocks", "16")
        wait_ready(address, ["i1"])
        tokens, where = _generate(address, "p", second, 8)
        assert where == "i1" and tokens == generate_reference(config, second, 8)
        st = status(address, "i1").instances[0]
        assert st.prefix_cache_storage_hit_tokens == 4 * BS, st
        assert st.prefix_cache_prefetched_hit_tokens == 4 * BS, st  # all before placement
        assert st.num_storage_prefetches == 4 and st.num_storage_fetches == 0, st
        assert st.num_swap_ins == 4 and st.num_storage_failures == 0, st
    finally:
        for p in (w1, daemon):
            if p is not None:
                p.stop()


def test_sim_worker_prefetches_for_a_request_waiting_for_a_slot() -> None:
    rng = np.random.default_rng(3708)
    prefix = rng.integers(2, 30000, size=4 * BS).tolist()
    first = prefix + [5, 6, 7]
    second = prefix + [8, 9, 10, 11]
    blocker = rng.integers(2, 30000, size=20).tolist()
    sim = ("--num-blocks", "256", "--block-size", str(BS), "--num-slots", "1")
    daemon, address = start_daemon(
        "--storage",
        "mooncake",
        "--storage-write-policy",
        "write_through",
        env={"KVSCHED_ENGINE__CACHE__STORAGE_PREFETCH": "true"},
    )
    w1 = None
    try:
        _share(address, (first, second), sim)
        w1 = start_worker(address, "i1", *sim, "--host-blocks", "64")
        wait_ready(address, ["i1"])
        done: list[str] = []
        # The blocker takes the only slot for ~200 decode steps; the second request waits.
        t = threading.Thread(
            target=lambda: done.append(_generate(address, "blocker", blocker, 200)[1]),
            daemon=True,
        )
        t.start()
        _wait(lambda: status(address, "i1").instances[0].num_running == 1, "the blocker placed")
        tokens, where = _generate(address, "p", second, 4)
        t.join(60)
        assert done == ["i1"] and where == "i1" and len(tokens) == 4
        st = status(address, "i1").instances[0]
        assert st.prefix_cache_storage_hit_tokens == 4 * BS, st
        assert st.prefix_cache_prefetched_hit_tokens == 4 * BS, st
        assert st.num_storage_prefetches == 4 and st.num_storage_fetches == 0, st
    finally:
        for p in (w1, daemon):
            if p is not None:
                p.stop()
