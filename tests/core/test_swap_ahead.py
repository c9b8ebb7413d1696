"""Swap-ins ahead of the first chunk (`CacheConfig.swap_in_ahead`, issue 37 item 2): a request
placed with host hits worth at least that share of a step gets its placement and swap-ins in
one Tasks message and its first chunk in the next, so a worker with a copy stream runs the copy
beside a step instead of before one. Driven here by the real scheduler and the real
WorkerEngine over the SimExecutor (priced copies), integrity checked after every step: every
GPU block returned, every host pin released."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core import Request, Scheduler, StorageIndex, Tasks
from kvsched.core.errors import ConfigError
from kvsched.worker_stub.costmodel import KV_BYTES_PER_TOKEN
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.sim import SimExecutor
from tests.core.factories import make_config, make_request
from tests.test_worker_engine import place, prompt_chunk

BS, EOS = 16, 2
BLOCK_BYTES = KV_BYTES_PER_TOKEN * BS
A = list(range(1000, 1000 + 6 * BS))  # 6 full blocks


class Pair:
    """One instance: the scheduler and a sim worker, one step per schedule()."""

    def __init__(self, storage: bool = False, **kw: Any) -> None:
        kw = {"block_size": BS, "num_gpu_blocks": 16, "num_host_blocks": 32, **kw}
        kw.setdefault("host_write_policy", "write_back")
        kw.update(prealloc_threshold=0, prealloc_blocks=1, max_model_len=8192)
        index = StorageIndex() if storage else None
        self.s = Scheduler(
            make_config(**kw), instance_id="i0", storage=index, storage_namespace="m"
        )
        # Llama-3-8B blocks (2 MiB) over PCIe at 50 GB/s: 0.04 ms a block, priced by the sim.
        self.sim = SimExecutor(gpu="h100", block_bytes=BLOCK_BYTES, eos_token_id=EOS)
        self.w = WorkerEngine(self.sim, BS, 64, EOS, 8192)
        self.sent: list[Tasks] = []
        self.step_s: list[float] = []
        self.added: set[str] = set()

    def add(self, r: Request) -> None:
        self.s.add_request(r)
        self.added.add(r.req_id)

    def step(self) -> Tasks:
        t = self.s.schedule()
        self.s.check_integrity()
        if not t.is_empty():
            self.sent.append(t)
            self.w.apply(t)
        report = self.w.step()
        if report is not None:
            self.step_s.append(report.step_time_ns / 1e9)
            self.s.apply_report(report)
            self.s.check_integrity()
        return t

    def run(self, *reqs: Request, limit: int = 200) -> None:
        for r in reqs:
            if r.req_id not in self.added:
                self.add(r)
        host = self.s.kv.host
        for _ in range(limit):
            busy = host is not None and (host.has_queued() or host.num_in_flight)
            if all(r.is_finished for r in reqs) and not busy:
                return
            self.step()
        raise AssertionError("requests did not finish")

    def host_hits_for(self, a: Request) -> list[int]:
        """Run `a`, then a prompt that evicts it to the host tier; a's host blocks."""
        self.run(a)
        self.run(make_request(list(range(5000, 5000 + 16 * BS - 1)), max_tokens=1))
        host = self.s.kv.host
        assert host is not None
        blocks = [host.lookup(h) for h in a.block_hashes[:6]]
        assert None not in blocks, "a's blocks went to the host tier"
        return blocks  # type: ignore[return-value]

    def assert_all_returned(self) -> None:
        """Nothing live: every GPU block free (cached ones in the LRU), no host pin."""
        s = self.s
        assert not s.live and s.kv.pool.num_free == s.kv.pool.num_blocks
        host = s.kv.host
        if host is not None:
            assert host.num_in_flight == 0 and not host.has_queued()
            assert all(n == 0 for n in host.pool.ref_cnt), "a host pin was never released"


def test_swap_ins_go_one_message_ahead_of_the_first_chunk() -> None:
    p = Pair(swap_in_ahead=0.01)
    src = p.host_hits_for(make_request(A + [1], max_tokens=1))
    b = make_request(A + list(range(9000, 9010)), max_tokens=3)
    p.add(b)
    t1 = p.step()
    (pl,) = t1.placements
    assert pl.num_cached_tokens == 6 * BS
    assert t1.swap_in_handles == [b.handle] * 6 and t1.swap_in_host == src
    assert not [c for c in t1.chunks if c.handle == b.handle], "the chunk waits a message"
    t2 = p.step()
    (c,) = [c for c in t2.chunks if c.handle == b.handle]
    assert c.start == 6 * BS and not t2.swap_in_gpu
    p.run(b)
    assert b.num_output_tokens == 3 and b.num_cached_tokens == 6 * BS
    assert p.s.kv.host is not None and p.s.kv.host.stats.swap_ins_ahead == 6
    assert p.s.snapshot().prefix_cache_host_hit_tokens == 6 * BS
    p.assert_all_returned()


def _worker_step_with(
    ahead: bool, chunk_later: bool = False, fetch: bool = False
) -> tuple[float, float]:
    """A sim worker decoding one request gets a placement with 6 blocks of swap-ins (its
    chunk in the same message, or none: sent ahead; chunk_later: the chunk in a second
    message at the same boundary). Returns (that step's time, a plain decode step's)."""
    sim = SimExecutor(gpu="h100", block_bytes=8 << 20, eos_token_id=EOS)  # 0.17 ms a block
    w = WorkerEngine(sim, BS, 8, EOS, 8192)
    p1 = place(1, prompt_len=BS, num_blocks=8)
    w.apply(Tasks(1, placements=[p1], chunks=[prompt_chunk(1, 0, BS)]))
    w.step()
    base = w.step()
    assert base is not None
    p2 = place(2, prompt_len=6 * BS + 4, num_blocks=7, num_cached=6 * BS)
    chunk = prompt_chunk(2, 6 * BS, 6 * BS + 4)
    gpu = p2.block_ids[:6]
    if fetch:  # from the storage tier (12.5 GB/s by default)
        keys = [f"k{i}" for i in range(6)]
        ins: dict[str, Any] = {"storage_fetch_handles": [2] * 6, "storage_fetch_keys": keys}
        ins["storage_fetch_gpu"] = gpu
    else:  # from host memory (PCIe, 50 GB/s)
        ins = {"swap_in_handles": [2] * 6, "swap_in_host": list(range(6)), "swap_in_gpu": gpu}
    w.apply(Tasks(2, placements=[p2], chunks=[] if ahead else [chunk], **ins))
    if chunk_later:
        w.apply(Tasks(3, chunks=[chunk]))
    report = w.step()
    assert report is not None
    return report.step_time_ns / 1e9, base.step_time_ns / 1e9


def test_the_copy_ahead_runs_beside_the_step_and_before_it_when_read() -> None:
    """The sim prices a swap-in with no chunk at its boundary beside the step (the step lasts
    max(compute, copy)), one a chunk reads before it (compute + copy)."""
    copy_s = 6 * (8 << 20) / 50e9
    ahead, base = _worker_step_with(ahead=True)
    assert ahead == pytest.approx(max(base, copy_s), rel=0.05), "beside the decode step"
    together, _ = _worker_step_with(ahead=False)
    assert together >= base + copy_s
    later, _ = _worker_step_with(ahead=True, chunk_later=True)
    assert later == pytest.approx(together), "read at the same boundary: before the step"


def test_a_storage_fetch_ahead_runs_beside_the_step_and_before_it_when_read() -> None:
    fetch_s = 6 * (8 << 20) / 12.5e9
    ahead, base = _worker_step_with(ahead=True, fetch=True)
    assert ahead == pytest.approx(max(base, fetch_s), rel=0.05)
    together, _ = _worker_step_with(ahead=False, fetch=True)
    assert together >= base + fetch_s
    later, _ = _worker_step_with(ahead=True, chunk_later=True, fetch=True)
    assert later == pytest.approx(together)


def test_below_the_share_the_swap_ins_travel_with_the_chunk() -> None:
    p = Pair(swap_in_ahead=1000.0)
    p.host_hits_for(make_request(A + [1], max_tokens=1))
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    p.add(b)
    t1 = p.step()
    assert t1.swap_in_handles == [b.handle] * 6
    assert [c.start for c in t1.chunks if c.handle == b.handle] == [6 * BS]
    p.run(b)
    assert p.s.kv.host is not None and p.s.kv.host.stats.swap_ins_ahead == 0
    p.assert_all_returned()


def test_preempted_between_its_swap_ins_and_its_first_chunk_returns_everything() -> None:
    """Paused right after the message with the swap-ins (no report yet): its GPU blocks go
    back unregistered, the host sources stay pinned until the ack, then it runs again."""
    p = Pair(swap_in_ahead=0.01)
    src = p.host_hits_for(make_request(A + [1], max_tokens=1))
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    p.add(b)
    t1 = p.s.schedule()
    p.s.check_integrity()
    assert t1.swap_in_host == src and not t1.chunks
    host = p.s.kv.host
    assert host is not None
    p.w.apply(t1)
    p.s.pause()
    p.s.check_integrity()
    assert [host.pool.ref_cnt[x] for x in src] == [1] * 6, "pinned until the ack"
    t2 = p.s.schedule()
    assert b.handle in t2.preempts
    p.w.apply(t2)
    report = p.w.step()
    assert report is not None
    p.s.apply_report(report)
    p.s.check_integrity()
    assert [host.pool.ref_cnt[x] for x in src] == [0] * 6
    p.s.resume()
    p.run(b)
    assert b.num_output_tokens == 2
    p.assert_all_returned()


def test_a_chunk_at_the_same_boundary_pays_the_copy_before_the_step() -> None:
    """Both messages reach the worker before its next step (it was idle): the chunk reads the
    swap-ins, so the sim prices them before the step, as without the option."""
    p = Pair(swap_in_ahead=0.01)
    p.host_hits_for(make_request(A + [1], max_tokens=1))
    b = make_request(A + list(range(9000, 9010)), max_tokens=2)
    p.add(b)
    t1 = p.s.schedule()
    t2 = p.s.schedule()
    assert t1.swap_in_gpu and not t1.chunks and [c.handle for c in t2.chunks] == [b.handle]
    p.w.apply(t1)
    p.w.apply(t2)
    assert not p.w._copies.ahead, "read by t2's chunk: no longer ahead"
    report = p.w.step()
    assert report is not None
    assert report.step_time_ns / 1e9 >= 6 * BLOCK_BYTES / 50e9
    p.s.apply_report(report)
    p.s.check_integrity()
    p.run(b)
    p.assert_all_returned()


def test_the_share_is_checked() -> None:
    with pytest.raises(ConfigError, match="swap_in_ahead"):
        make_config(swap_in_ahead=-1.0).validate()


def test_storage_fetches_go_ahead_too_and_run_beside_the_step() -> None:
    """No host tier, write_through storage from the GPU: a's blocks are written, evicted from
    the GPU, then b's storage hits are fetched a message ahead of its first chunk; the sim
    prices them beside that step."""
    p = Pair(
        storage=True, num_host_blocks=0, storage_write_policy="write_through", swap_in_ahead=0.01
    )
    a = make_request(A + [1], max_tokens=1)
    p.run(a)
    p.run(make_request(list(range(5000, 5000 + 16 * BS - 1)), max_tokens=1))
    assert p.s.kv.pool.lookup(a.block_hashes[0]) is None, "a left the GPU"
    b = make_request(A + list(range(9000, 9010)), max_tokens=3)
    p.add(b)
    t1 = p.step()
    assert t1.storage_fetch_handles == [b.handle] * 6 and not t1.chunks
    assert p.s.kv.storage is not None and p.s.kv.storage.stats.fetches_ahead == 6
    assert p.sim.num_fetched_blocks == 6
    t2 = p.step()
    assert [c.start for c in t2.chunks if c.handle == b.handle] == [6 * BS]
    p.run(b)
    assert b.num_cached_tokens == 6 * BS and b.num_output_tokens == 3
    p.assert_all_returned()
