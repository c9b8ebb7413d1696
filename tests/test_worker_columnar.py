"""The columnar decode path (WorkerEngine(columnar=True)) gives the same results as the SeqWork
path, and the worker's messages through kvsched.codec round-trip."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvsched import codec
from kvsched.core.protocol import (
    Chunk,
    Extension,
    FinishReason,
    KvSend,
    Placement,
    SamplingParams,
    StepReport,
    Tasks,
)
from kvsched.v1 import worker_service_pb2 as pb
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_stub.sim import SimExecutor
from tests.reports import listed

EOS = 2
BLOCK = 4
NUM_SLOTS = 6
MAX_MODEL_LEN = 32


def rows(report: StepReport) -> dict[int, tuple[int, list[int], int]]:
    """handle -> (num_computed, new tokens, finish reason): the report without its row order."""
    out, off = {}, 0
    for h, comp, n, fin in zip(
        report.handles,
        report.num_computed,
        report.num_new_tokens,
        report.finish_reasons,
        strict=True,
    ):
        out[h] = (comp, report.token_ids[off : off + n], fin)
        off += n
    assert off == len(report.token_ids)
    return out


class Driver:
    """Random but valid Tasks for two engines at once: placements (fresh prompts, prefix hits,
    hand-offs), chunks in order (sometimes one step ahead), extensions, preempts, aborts."""

    def __init__(self, rng: random.Random, sim: SimExecutor) -> None:
        self.rng = rng
        self.sim = sim  # its tokens make stop ids that do stop
        self.next_handle = 1
        self.next_block = 0
        self.seq = 0
        self.slots: dict[int, int] = {}  # slot -> handle, as far as the driver knows
        self.prompts: dict[int, tuple[int, int]] = {}  # handle -> (next chunk start, prompt len)

    def tasks(self, held: set[int]) -> Tasks:
        rng = self.rng
        self.seq += 1
        tasks = Tasks(self.seq)
        self.slots = {s: h for s, h in self.slots.items() if h in held}
        for handle in list(self.slots.values()):
            if rng.random() < 0.03:
                (tasks.preempts if rng.random() < 0.5 else tasks.aborts).append(handle)
                self.slots = {s: h for s, h in self.slots.items() if h != handle}
        free = [s for s in range(NUM_SLOTS) if s not in self.slots]
        if free and rng.random() < 0.4:
            self._place(tasks, rng.choice(free))
        for handle in self.slots.values():
            if rng.random() < 0.15:
                tasks.extensions.append(Extension(handle, self._blocks(rng.randint(1, 2))))
            self._chunk(tasks, handle)
        if rng.random() < 0.05:
            tasks.extensions.append(Extension(10_000 + self.seq, [1]))  # never placed: acked
        return tasks

    def _blocks(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def _place(self, tasks: Tasks, slot: int) -> None:
        rng, handle = self.rng, self.next_handle
        self.next_handle += 1
        prompt_len = rng.randint(1, 14)
        cached = rng.choice([0, 0, prompt_len // 2, prompt_len])
        stop_ids = []
        if rng.random() < 0.3:
            stop_ids = [self.sim.token_at(f"r{handle}", prompt_len + rng.randint(1, 9)), EOS + 1]
        sampling = SamplingParams(
            max_tokens=rng.randint(1, 40),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=stop_ids,
            ignore_eos=rng.random() < 0.2,
        )
        last = rng.randint(3, 30) if cached == prompt_len else -1
        num_blocks = rng.randint(-(-max(prompt_len, 1) // BLOCK) - 1, 5)
        placement = Placement(
            handle,
            slot,
            f"r{handle}",
            self._blocks(max(num_blocks, 1)),
            cached,
            prompt_len,
            rng.choice([0, 0, 2]),
            last,
            sampling,
        )
        tasks.placements.append(placement)
        self.slots[slot] = handle
        self.prompts[handle] = (cached, prompt_len)
        if cached < prompt_len and rng.random() < 0.2:
            tasks.kv_sends.append(KvSend(handle, "d", handle, list(range(8))))

    def _chunk(self, tasks: Tasks, handle: int) -> None:
        start, prompt_len = self.prompts.get(handle, (0, 0))
        if start >= prompt_len or self.rng.random() < 0.3:
            return
        end = min(prompt_len, start + self.rng.randint(1, 6))
        tasks.chunks.append(Chunk(handle, start, [100 + i for i in range(start, end)]))
        self.prompts[handle] = (end, prompt_len)


def engines(eos_every: int | None, zero_cost: bool) -> tuple[WorkerEngine, WorkerEngine]:
    def make(columnar: bool) -> WorkerEngine:
        sim = SimExecutor(zero_cost=zero_cost, eos_token_id=EOS, eos_every=eos_every)
        sender = lambda send, data: None  # noqa: E731
        return WorkerEngine(
            sim, BLOCK, NUM_SLOTS, EOS, MAX_MODEL_LEN, kv_sender=sender, columnar=columnar
        )

    return make(False), make(True)


@pytest.mark.parametrize("seed", range(12))
def test_columnar_steps_match_seqwork_steps(seed: int) -> None:
    rng = random.Random(seed)
    eos_every = rng.choice([None, 4, 9])
    reference, columnar = engines(eos_every, zero_cost=seed % 3 == 0)
    driver = Driver(rng, SimExecutor(eos_token_id=EOS, eos_every=eos_every))
    num_rows = num_paused = 0
    finished: set[int] = set()
    for _ in range(400):
        held = {h for h in range(1, driver.next_handle) if reference.holds(h)}
        assert held == {h for h in range(1, driver.next_handle) if columnar.holds(h)}
        tasks = driver.tasks(held)
        reference.apply(tasks)
        columnar.apply(tasks)
        assert reference.has_runnable() == columnar.has_runnable()
        want, got = reference.step(), columnar.step()
        if want is None or got is None:
            assert want is None and got is None
            continue
        assert (got.step, got.applied_seq, got.step_time_ns) == (
            want.step,
            want.applied_seq,
            want.step_time_ns,
        )
        assert rows(got) == rows(want)
        assert sorted(got.paused) == sorted(want.paused)
        assert got.acked == want.acked and got.failed == want.failed
        num_rows += len(want.handles)
        num_paused += len(want.paused)
        finished.update(r for r in want.finish_reasons if r != FinishReason.NONE)
    assert num_rows > 300 and num_paused > 5  # the run covered them
    assert finished == {FinishReason.STOP, FinishReason.LENGTH}


def test_columnar_needs_an_executor_with_columns() -> None:
    class Plain:
        name = "plain"

    with pytest.raises(ValueError, match="columnar"):
        WorkerEngine(Plain(), BLOCK, 2, EOS, 64, columnar=True)  # type: ignore[arg-type]


def test_speculative_engine_keeps_the_seqwork_path() -> None:
    seen: list[list[SeqWork]] = []

    class Recording(SimExecutor):
        def execute(self, work: list[SeqWork]):  # type: ignore[no-untyped-def]
            seen.append(work)
            return super().execute(work)

    sim = Recording(zero_cost=True, eos_token_id=EOS)
    engine = WorkerEngine(sim, BLOCK, 2, EOS, 64, 2, columnar=True)
    params = SamplingParams(max_tokens=5)
    p = Placement(1, 0, "r1", [0, 1, 2], 4, 4, 0, 7, params)
    engine.apply(Tasks(1, placements=[p]))
    while engine.step() is not None:
        pass
    assert seen and all(w[0].sample for w in seen)


# ---- the sim's columns ------------------------------------------------------------------------


@pytest.mark.parametrize("eos_every", [None, 1, 5])
def test_decode_tokens_equal_token_at(eos_every: int | None) -> None:
    sim = SimExecutor(seed=7, eos_every=eos_every)
    req_ids = [f"req-{i}" for i in range(200)]
    positions = np.arange(200, dtype=np.int64) * 13 + 5
    keys = np.array([sim.request_key(r) for r in req_ids], dtype=np.uint64)
    want = [sim.token_at(r, int(p)) for r, p in zip(req_ids, positions, strict=True)]
    assert sim.decode_tokens(keys, positions).tolist() == want


def test_execute_columns_times_like_execute() -> None:
    sim = SimExecutor(gpu="a100", speed=2.0)
    params = SamplingParams()
    chunk = SeqWork(1, "a", [0, 1], 0, [5] * 7, False, 0, params)
    decodes = [SeqWork(2 + i, f"d{i}", [0], p, [9], True, 0, params) for i, p in enumerate([3, 40])]
    positions = np.array([4, 41], dtype=np.int64)
    keys = np.array([sim.request_key("d0"), sim.request_key("d1")], dtype=np.uint64)
    result, tokens = sim.execute_columns([chunk], keys, positions)
    assert result.step_time_s == sim.step_time_s([chunk, *decodes])
    assert result.tokens == [[]]
    assert tokens.tolist() == [sim.token_at("d0", 4), sim.token_at("d1", 41)]


# ---- wire -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_new", "reasons"),
    [([1, 1, 1], [0, 0, 0]), ([1, 3, 1], [0, 2, 0]), ([200, 200, 200], [1, 1, 1]), ([], [])],
)
def test_report_message_matches_convert(num_new: list[int], reasons: list[int]) -> None:
    n = len(num_new)
    report = StepReport(
        step=9,
        applied_seq=4,
        handles=list(range(1, n + 1)),
        num_computed=[300_000 + i for i in range(n)],
        num_new_tokens=num_new,
        token_ids=list(range(sum(num_new))),
        finish_reasons=reasons,
        acked=[7],
        paused=[8, 9] if n else [],
        failed=[],
        step_time_ns=123,
    )
    got = codec.report_message(report)
    assert got == pb.ConnectRequest(report=codec.report_to_proto(report))
    back = codec.report_from_proto(pb.ConnectRequest.FromString(got.SerializeToString()).report)
    assert listed(back) == report


def test_tasks_from_proto_matches_convert() -> None:
    params = SamplingParams(max_tokens=9, stop_token_ids=[4])
    tasks = Tasks(
        5,
        preempts=[1],
        aborts=[2],
        placements=[Placement(3, 0, "r", [1, 2], 0, 6, 0, -1, params)],
        extensions=[Extension(3, [7]), Extension(4, [8, 9])],
        chunks=[Chunk(3, 0, [1, 2, 3])],
        kv_sends=[KvSend(3, "d", 11, [4, 5])],
        reset_prefix_cache=True,
    )
    for t in (tasks, Tasks(6), Tasks(7, extensions=[Extension(1, [])])):
        msg = codec.tasks_to_proto(t)
        assert codec.tasks_from_proto(msg) == t


@pytest.mark.parametrize("section", ["extensions", "chunks", "kv_sends"])
def test_tasks_from_proto_rejects_columns_that_disagree(section: str) -> None:
    t = Tasks(
        1,
        extensions=[Extension(1, [2])],
        chunks=[Chunk(1, 0, [3])],
        kv_sends=[KvSend(1, "d", 1, [4])],
    )
    msg = codec.tasks_to_proto(t)
    getattr(msg, section).handles.append(2)
    with pytest.raises(ValueError, match=section):
        codec.tasks_from_proto(msg)
