"""The worker's side of the storage tier (kvsched/worker_stub/storage_kv.py) with hand-built
Tasks: storage writes right after swap-outs and fetches after swap-ins, before chunks; the
report that acknowledges them and names failures; a failed fetch's handle runs nothing; the sim
prices transfers; the model executor moves real block bytes through a real Mooncake Store."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvsched.core.protocol import Tasks
from kvsched.storage import MooncakeStore, mooncake_available
from kvsched.storage.server import MooncakeServer, free_port
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.model import ModelConfig, PagedModelExecutor
from kvsched.worker_stub.sim import SimExecutor
from kvsched.worker_stub.storage_kv import StoreLink, reachable_backends
from tests.test_worker_engine import BLOCK, EOS, Recording, place, prompt_chunk


class Logged(Recording):
    """The sim, logging host copies and storage transfers in the order they run."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        self.log.append("swap_out")

    def swap_in(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        self.log.append("swap_in")

    def storage_copied(self, num_blocks: int, *, write: bool) -> None:
        self.log.append(f"{'write' if write else 'fetch'}:{num_blocks}")
        super().storage_copied(num_blocks, write=write)


def test_order_writes_after_swap_outs_fetches_after_swap_ins_before_chunks() -> None:
    ex = Logged()
    eng = WorkerEngine(ex, BLOCK, 4, EOS, 64)
    p = place(1, prompt_len=14, num_cached=12)
    eng.apply(
        Tasks(
            1,
            placements=[p],
            chunks=[prompt_chunk(1, 12, 14)],
            swap_out_gpu=[7],
            swap_out_host=[3],
            storage_write_keys=["k7"],
            storage_write_blocks=[3],
            swap_in_handles=[1],
            swap_in_host=[5],
            swap_in_gpu=p.block_ids[:1],
            storage_fetch_handles=[1, 1],
            storage_fetch_keys=["a", "b"],
            storage_fetch_gpu=p.block_ids[1:3],
        )
    )
    assert ex.log == ["swap_out", "write:1", "swap_in", "fetch:2"]
    assert not ex.batches, "storage tasks run when the message is applied, before the step"
    report = eng.step()
    assert report is not None and report.applied_seq == 1 and report.handles == [1]
    assert not report.failed_storage_writes and not report.failed_storage_fetches


def test_storage_tasks_alone_are_reported_so_the_daemon_sees_them_acknowledged() -> None:
    eng = WorkerEngine(Logged(), BLOCK, 4, EOS, 64)
    eng.apply(Tasks(1, storage_write_keys=["a", "b"], storage_write_blocks=[0, 1]))
    assert eng.has_runnable()
    report = eng.step()
    assert report is not None and report.applied_seq == 1 and not report.handles
    assert not eng.has_runnable() and eng.step() is None


def test_sim_prices_fetches_before_the_step_and_overlaps_writes() -> None:
    block_bytes = 1 << 20
    sim = SimExecutor(block_bytes=block_bytes, storage_gbps=1.0)
    per_block = block_bytes / 1e9
    sim.storage_copied(10, write=False)
    fetch_step = sim.execute([]).step_time_s
    assert fetch_step == pytest.approx(10 * per_block)
    assert sim.execute([]).step_time_s == 0.0  # paid once
    sim.storage_copied(3, write=True)
    assert sim.execute([]).step_time_s == pytest.approx(3 * per_block)  # an idle step waits
    sim.storage_copied(3, write=True)
    sim.storage_copied(4, write=False)
    assert sim.execute([]).step_time_s == pytest.approx(4 * per_block)  # writes hidden
    assert (sim.num_stored_blocks, sim.num_fetched_blocks) == (6, 14)
    with pytest.raises(ValueError, match="storage_gbps"):
        SimExecutor(storage_gbps=0)


def test_backends_announced() -> None:
    assert reachable_backends("sim") == ("mooncake",)
    # model and vllm move real bytes: they reach the store when its client is installed
    real = ("mooncake",) if mooncake_available() else ()
    assert reachable_backends("model") == reachable_backends("vllm") == real
    assert reachable_backends("paddle") == ()


def _model(num_host_blocks: int = 0) -> PagedModelExecutor:
    return PagedModelExecutor(
        ModelConfig(), num_blocks=8, block_size=BLOCK, num_host_blocks=num_host_blocks
    )


def _block(ex: PagedModelExecutor, gpu_id: int) -> np.ndarray:
    return np.asarray(ex.k_cache[1][gpu_id * BLOCK : (gpu_id + 1) * BLOCK]).copy()


_links: list[StoreLink] = []  # the running test's, closed at its end (`_close_links`)


@pytest.fixture(autouse=True)
def _close_links() -> Iterator[None]:
    """A Mooncake client's close holds the GIL (~1 s): each test closes its own, rather than
    leaving them to the garbage collector during a later test of the same process."""
    yield
    while _links:
        _links.pop().close()


def _engine(ex: PagedModelExecutor, url: str) -> WorkerEngine:
    eng = WorkerEngine(ex, BLOCK, 4, ModelConfig().eos_token_id, 64)
    eng.storage.link = StoreLink()
    _links.append(eng.storage.link)
    eng.storage.link.use(url)
    return eng


def test_model_executor_blocks_travel_through_the_store(mooncake: MooncakeServer) -> None:
    """One worker writes GPU blocks 2 and 5; another (its cache other noise) fetches them
    into its blocks 0 and 1 of a handle: the bytes arrive, the handle's chunk runs."""
    a, b = _model(), _model()
    b.k_cache[1][:] = b.backend.asarray(
        np.random.default_rng(7).standard_normal(b.k_cache[1].shape)
    )
    want = [_block(a, 2), _block(a, 5)]
    assert not np.array_equal(_block(b, 0), want[0])
    wa, wb = _engine(a, mooncake.url), _engine(b, mooncake.url)
    wa.apply(Tasks(1, storage_write_keys=["m/x2", "m/x5"], storage_write_blocks=[2, 5]))
    report = wa.step()
    assert report is not None and report.failed_storage_writes == []
    p = place(1, prompt_len=10, num_cached=8)
    p.block_ids = [0, 1, 3]
    wb.apply(
        Tasks(
            1,
            placements=[p],
            chunks=[prompt_chunk(1, 8, 10)],
            storage_fetch_handles=[1, 1],
            storage_fetch_keys=["m/x2", "m/x5"],
            storage_fetch_gpu=[0, 1],
        )
    )
    assert np.array_equal(_block(b, 0), want[0]) and np.array_equal(_block(b, 1), want[1])
    report = wb.step()
    assert report is not None and report.handles == [1] and report.failed_storage_fetches == []


def test_model_executor_with_a_host_tier_writes_host_blocks(mooncake: MooncakeServer) -> None:
    a, b = _model(num_host_blocks=4), _model()
    a.swap_out([6], [2])  # GPU block 6 -> host block 2; the daemon names host block 2
    want = _block(a, 6)
    wa, wb = _engine(a, mooncake.url), _engine(b, mooncake.url)
    wa.apply(Tasks(1, storage_write_keys=["h/2"], storage_write_blocks=[2]))
    assert wa.step() is not None
    wb.apply(Tasks(1, storage_fetch_handles=[9], storage_fetch_keys=["h/2"], storage_fetch_gpu=[4]))
    assert np.array_equal(_block(b, 4), want)


def test_failed_fetch_is_reported_and_its_handle_runs_nothing(mooncake: MooncakeServer) -> None:
    """A key the store does not hold (evicted, removed): the handle is named in
    failed_storage_fetches, its chunks are dropped (later ones too) until the preempt."""
    ex = _model()
    eng = _engine(ex, mooncake.url)
    eng.apply(Tasks(1, storage_write_keys=["f/ok"], storage_write_blocks=[5]))
    eng.step()
    p, q = place(2, prompt_len=10, num_cached=8), place(3, prompt_len=6, num_cached=4)
    p.block_ids, q.block_ids = [0, 1, 2], [3, 4]
    eng.apply(
        Tasks(
            2,
            placements=[p, q],
            chunks=[prompt_chunk(2, 8, 10), prompt_chunk(3, 4, 6)],
            storage_fetch_handles=[2, 2, 3],
            storage_fetch_keys=["f/ok", "f/missing", "f/ok"],
            storage_fetch_gpu=[0, 1, 3],
        )
    )
    report = eng.step()
    assert report is not None and report.failed_storage_fetches == [2]
    assert report.handles == [3], "the other handle's fetch succeeded: it runs"
    eng.apply(Tasks(3, chunks=[prompt_chunk(2, 8, 10)]))
    r = eng.step()
    assert r is None or 2 not in list(r.handles)
    eng.apply(Tasks(4, preempts=[2]))
    report = eng.step()
    assert report is not None and 2 in report.acked and not eng.holds(2)


def test_unreachable_store_fails_every_storage_task(caplog: pytest.LogCaptureFixture) -> None:
    url = f"mooncake://127.0.0.1:{free_port()}?metadata=127.0.0.1:{free_port()}"
    with caplog.at_level(logging.ERROR):
        eng = _engine(_model(), url)
    assert any("cannot connect" in r.message and r.levelno == logging.ERROR for r in caplog.records)
    p = place(1, prompt_len=10, num_cached=8)
    p.block_ids = [0, 1, 2]
    eng.apply(
        Tasks(
            1,
            placements=[p],
            chunks=[prompt_chunk(1, 8, 10)],
            storage_write_keys=["u/a", "u/b"],
            storage_write_blocks=[4, 5],
            storage_fetch_handles=[1, 1],
            storage_fetch_keys=["u/a", "u/b"],
            storage_fetch_gpu=[0, 1],
        )
    )
    report = eng.step()
    assert report is not None
    assert report.failed_storage_writes == ["u/a", "u/b"]
    assert report.failed_storage_fetches == [1] and report.handles == []


def test_master_killed_mid_way_fails_tasks_then_recovers(fresh_mooncake: MooncakeServer) -> None:
    ex = _model()
    eng = _engine(ex, fresh_mooncake.url)
    eng.apply(Tasks(1, storage_write_keys=["k/a"], storage_write_blocks=[5]))
    assert eng.step().failed_storage_writes == []  # type: ignore[union-attr]
    fresh_mooncake.kill_master()
    p = place(1, prompt_len=10, num_cached=4)
    p.block_ids = [0, 1, 2]
    eng.apply(
        Tasks(
            2,
            placements=[p],
            chunks=[prompt_chunk(1, 4, 10)],
            storage_write_keys=["k/b"],
            storage_write_blocks=[6],
            storage_fetch_handles=[1],
            storage_fetch_keys=["k/a"],
            storage_fetch_gpu=[0],
        )
    )
    report = eng.step()
    assert report is not None
    assert report.failed_storage_writes == ["k/b"] and report.failed_storage_fetches == [1]


def test_store_restarted_after_a_crash_is_used_again(fresh_mooncake: MooncakeServer) -> None:
    """Master killed: tasks fail (and for _RETRY_S fail at once); the store comes back empty:
    the link finds it answering again and the next tasks succeed, through the same client
    (never closed for the outage: its close holds the GIL for up to seconds)."""
    eng = _engine(_model(), fresh_mooncake.url)
    link = eng.storage.link
    assert link is not None and link.store is not None
    client = link.store
    fresh_mooncake.kill_master()
    eng.apply(Tasks(1, storage_write_keys=["r/a"], storage_write_blocks=[5]))
    assert eng.step().failed_storage_writes == ["r/a"]  # type: ignore[union-attr]
    fresh_mooncake.restart()
    deadline = time.monotonic() + 30
    seq, failed = 1, ["r/a"]
    while failed and time.monotonic() < deadline:
        time.sleep(0.5)
        seq += 1
        eng.apply(Tasks(seq, storage_write_keys=["r/a"], storage_write_blocks=[5]))
        failed = eng.step().failed_storage_writes  # type: ignore[union-attr]
    assert not failed, "the worker never wrote to the restarted store"
    assert link.store is client and link.num_outages == 1 and not link.is_down
    with MooncakeStore.connect(fresh_mooncake.url) as store:
        assert store.exists("r/a")
