"""WorkerEngine's side of the host KV tier (kvsched/worker_stub/host_kv.py), with hand-built
Tasks over an executor that records the copies: their place in the step-boundary order, the
report that acknowledges them, failures, and the model executor's copies of real KV."""

from __future__ import annotations

import numpy as np

from kvsched.core.protocol import Tasks
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.model import ModelConfig, PagedModelExecutor
from tests.test_worker_engine import BLOCK, EOS, Recording, place, prompt_chunk


class Copying(Recording):
    """Records copies and resets in the order they happen; fails swap-ins of `fail` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, list[int]]] = []
        self.fail: set[int] = set()

    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        self.log.append(("out", list(gpu_ids)))

    def swap_in(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        if self.fail & set(host_ids):
            raise RuntimeError("injected")
        self.log.append(("in", list(gpu_ids)))

    def drop_host(self) -> None:
        self.log.append(("drop", []))


def engine() -> tuple[WorkerEngine, Copying]:
    ex = Copying()
    return WorkerEngine(ex, BLOCK, 4, EOS, 64), ex


def test_reset_then_swap_outs_then_swap_ins_then_chunks() -> None:
    eng, ex = engine()
    p = place(1, prompt_len=10, num_cached=8)
    eng.apply(
        Tasks(
            1,
            placements=[p],
            chunks=[prompt_chunk(1, 8, 10)],
            swap_out_gpu=[7],
            swap_out_host=[3],
            swap_in_handles=[1, 1],
            swap_in_host=[5, 6],
            swap_in_gpu=p.block_ids[:2],
            reset_prefix_cache=True,
        )
    )
    assert [k for k, _ in ex.log] == ["drop", "out", "in"]
    assert not ex.batches, "copies run when the message is applied, before the step"
    report = eng.step()
    assert report is not None and report.applied_seq == 1
    assert report.handles == [1] and not report.failed_swap_ins


def test_copies_alone_are_reported_so_the_daemon_sees_them_acknowledged() -> None:
    eng, _ = engine()
    eng.apply(Tasks(1, swap_out_gpu=[0, 1], swap_out_host=[0, 1]))
    assert eng.has_runnable()
    report = eng.step()
    assert report is not None and report.applied_seq == 1 and not report.handles
    assert not eng.has_runnable() and eng.step() is None


def test_failed_swap_in_is_reported_and_its_handle_runs_nothing() -> None:
    eng, ex = engine()
    ex.fail = {9}
    p = place(2, prompt_len=10, num_cached=8)
    eng.apply(
        Tasks(
            1,
            placements=[p],
            chunks=[prompt_chunk(2, 8, 10)],
            swap_in_handles=[2, 2],
            swap_in_host=[9, 4],
            swap_in_gpu=p.block_ids[:2],
        )
    )
    eng.apply(Tasks(2, swap_out_gpu=[50], swap_out_host=[1]))
    report = eng.step()
    assert report is not None and report.failed_swap_ins == [2] and report.handles == []
    eng.apply(Tasks(3, chunks=[prompt_chunk(2, 8, 10)]))  # a later chunk is ignored too
    assert eng.step() is None
    eng.apply(Tasks(4, preempts=[2]))
    report = eng.step()
    assert report is not None and report.acked == [2] and not eng.holds(2)


def test_model_executor_round_trips_kv_through_host_memory_and_forgets_it_on_reset() -> None:
    ex = PagedModelExecutor(ModelConfig(), num_blocks=4, block_size=BLOCK, num_host_blocks=3)
    layer = ex.k_cache[0]
    before = np.array(layer[BLOCK : 2 * BLOCK])  # GPU block 1
    ex.swap_out([1], [2])
    ex.swap_in([2], [3])
    assert np.array_equal(np.asarray(ex.k_cache[0][3 * BLOCK : 4 * BLOCK]), before)
    ex.drop_host()
    ex.swap_in([2], [0])
    assert not np.array_equal(np.asarray(ex.k_cache[0][0:BLOCK]), before)
