"""WorkerEngine driven with hand-built core Tasks over the sim executor."""

from __future__ import annotations

from dataclasses import replace

import pytest

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
from kvsched.worker_stub.engine import ProtocolError, WorkerEngine, check_stop, ngram_draft
from kvsched.worker_stub.executor import SeqWork, StepResult
from kvsched.worker_stub.sim import SimExecutor

EOS = 2
BLOCK = 4


class Recording(SimExecutor):
    """The sim executor, remembering every batch it ran."""

    def __init__(self, **kw: object) -> None:
        super().__init__(zero_cost=True, eos_token_id=EOS, **kw)  # type: ignore[arg-type]
        self.batches: list[list[SeqWork]] = []

    def execute(self, work: list[SeqWork]) -> StepResult:
        self.batches.append(work)
        return super().execute(work)


def make_engine(
    eos_every: int | None = None, max_model_len: int = 64, **kw: object
) -> tuple[WorkerEngine, Recording]:
    sim = Recording(eos_every=eos_every)
    engine = WorkerEngine(sim, BLOCK, 4, EOS, max_model_len, **kw)  # type: ignore[arg-type]
    return engine, sim


def place(
    handle: int,
    prompt_len: int = 6,
    num_blocks: int = 4,
    slot: int | None = None,
    num_cached: int = 0,
    num_output: int = 0,
    last_token: int = -1,
    **sampling: object,
) -> Placement:
    params = SamplingParams(**{"max_tokens": 100, **sampling})  # type: ignore[arg-type]
    blocks = list(range(handle * 100, handle * 100 + num_blocks))
    slot = handle % 4 if slot is None else slot
    return Placement(
        handle,
        slot,
        f"req-{handle}",
        blocks,
        num_cached,
        prompt_len,
        num_output,
        last_token,
        params,
    )


def prompt_chunk(handle: int, start: int, end: int) -> Chunk:
    return Chunk(handle, start, [10 + i for i in range(start, end)])


def start(engine: WorkerEngine, seq: int, p: Placement) -> None:
    """Place p and queue its whole prompt as one chunk."""
    engine.apply(
        Tasks(seq, placements=[p], chunks=[prompt_chunk(p.handle, 0, p.num_prefill_tokens)])
    )


def rows(report: StepReport) -> dict[int, tuple[int, list[int], FinishReason]]:
    """handle -> (num_computed, new tokens, finish reason)"""
    out, off = {}, 0
    for h, comp, n, fin in zip(
        report.handles,
        report.num_computed,
        report.num_new_tokens,
        report.finish_reasons,
        strict=True,
    ):
        out[h] = (comp, report.token_ids[off : off + n], FinishReason(fin))
        off += n
    assert off == len(report.token_ids)
    return out


def step(engine: WorkerEngine) -> StepReport:
    report = engine.step()
    assert report is not None
    return report


def run_until_idle(engine: WorkerEngine, limit: int = 200) -> list[StepReport]:
    reports = []
    while (report := engine.step()) is not None:
        reports.append(report)
        assert len(reports) < limit
    return reports


# ---- prefill chunks ---------------------------------------------------------------------------


def test_chunks_run_in_order_one_per_step() -> None:
    engine, sim = make_engine()
    engine.apply(Tasks(1, placements=[place(1, prompt_len=10)], chunks=[prompt_chunk(1, 4, 8)]))
    assert not engine.has_runnable()  # the chunk at 4 waits for the one at 0
    engine.apply(Tasks(2, chunks=[prompt_chunk(1, 0, 4)]))
    assert rows(step(engine)) == {1: (4, [], FinishReason.NONE)}
    assert rows(step(engine)) == {1: (8, [], FinishReason.NONE)}
    assert engine.step() is None
    engine.apply(Tasks(3, chunks=[prompt_chunk(1, 8, 10)]))
    first = sim.token_at("req-1", 10)  # the prompt's last chunk samples position 10
    assert rows(step(engine)) == {1: (10, [first], FinishReason.NONE)}
    assert rows(step(engine)) == {1: (11, [sim.token_at("req-1", 11)], FinishReason.NONE)}
    starts = [[(w.start, len(w.token_ids), w.sample) for w in b] for b in sim.batches]
    assert starts == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)], [(10, 1, True)]]
    assert sim.batches[3][0].token_ids == [first]


def test_report_counters() -> None:
    engine, _ = make_engine()
    start(engine, 5, place(1))
    engine.apply(Tasks(7))
    reports = [step(engine), step(engine)]
    assert [(r.step, r.applied_seq) for r in reports] == [(1, 7), (2, 7)]


def test_stale_and_oversized_chunks() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1))
    step(engine)
    engine.apply(Tasks(2, chunks=[prompt_chunk(1, 0, 6)]))  # already computed: ignored
    assert rows(step(engine))[1][0] == 7
    engine.apply(Tasks(3, placements=[place(2, prompt_len=6)]))
    with pytest.raises(ProtocolError):
        engine.apply(Tasks(4, chunks=[prompt_chunk(2, 4, 8)]))


# ---- block room -------------------------------------------------------------------------------


def test_pause_on_full_blocks_and_resume_on_extension() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1, prompt_len=6, num_blocks=2))  # room for positions 0..7
    assert [rows(step(engine))[1][0] for _ in range(3)] == [6, 7, 8]
    paused = step(engine)
    assert paused.paused == [1] and paused.handles == []
    assert not engine.has_runnable() and engine.step() is None  # paused once per pause
    engine.apply(Tasks(2, extensions=[Extension(1, [999])]))
    assert [rows(step(engine))[1][0] for _ in range(4)] == [9, 10, 11, 12]
    assert step(engine).paused == [1]


def test_chunk_without_room_pauses_until_extended() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1, prompt_len=6, num_blocks=1))
    assert step(engine).paused == [1]
    assert engine.step() is None
    engine.apply(Tasks(2, extensions=[Extension(1, [5])]))
    assert rows(step(engine))[1][0] == 6


# ---- stop conditions --------------------------------------------------------------------------


def test_max_tokens_counts_outputs_of_earlier_placements() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1, num_output=3, max_tokens=5))
    (r1, r2) = run_until_idle(engine)
    assert rows(r1)[1][2] == FinishReason.NONE
    assert rows(r2)[1][2] == FinishReason.LENGTH
    assert not engine.holds(1)


def test_min_tokens_suppresses_eos() -> None:
    engine, _ = make_engine(eos_every=1)  # every sampled token is EOS
    start(engine, 1, place(1, min_tokens=3))
    reports = run_until_idle(engine)
    assert [rows(r)[1][1] for r in reports] == [[EOS], [EOS], [EOS]]
    assert rows(reports[-1])[1][2] == FinishReason.STOP


def test_eos_stops_and_ignore_eos_runs_to_max_tokens() -> None:
    engine, _ = make_engine(eos_every=1)
    start(engine, 1, place(1))
    start(engine, 2, place(2, ignore_eos=True, max_tokens=4))
    reports = run_until_idle(engine)
    assert rows(reports[0])[1] == (6, [EOS], FinishReason.STOP)
    assert rows(reports[-1])[2][2] == FinishReason.LENGTH
    assert sum(len(rows(r)[2][1]) for r in reports) == 4


def test_stop_token_ids() -> None:
    engine, sim = make_engine()
    stop = sim.token_at("req-1", 8)  # the third output of a 6-token prompt
    start(engine, 1, place(1, stop_token_ids=[stop]))
    reports = run_until_idle(engine)
    assert len(reports) == 3
    assert rows(reports[-1])[1] == (8, [stop], FinishReason.STOP)


def test_max_model_len() -> None:
    engine, _ = make_engine(max_model_len=10)
    start(engine, 1, place(1, prompt_len=6))
    reports = run_until_idle(engine)
    assert len(reports) == 4  # outputs at positions 6..9: num_tokens reaches 10
    assert rows(reports[-1])[1][0] == 9 and rows(reports[-1])[1][2] == FinishReason.LENGTH


def test_check_stop_truncates_at_the_stopping_token() -> None:
    params = SamplingParams(max_tokens=10)
    assert check_stop(params, [5, EOS, 7], 20, 0, EOS, 100) == (2, FinishReason.STOP)
    assert check_stop(params, [5, 6, 7], 20, 8, EOS, 100) == (2, FinishReason.LENGTH)
    assert check_stop(params, [5, 6, 7], 20, 0, EOS, 22) == (2, FinishReason.LENGTH)
    assert check_stop(params, [5, 6, 7], 20, 0, EOS, 100) == (3, FinishReason.NONE)


# ---- acknowledgements, preemption, protocol errors --------------------------------------------


def test_tasks_for_unknown_handles_are_acked_and_dropped() -> None:
    engine, _ = make_engine()
    engine.apply(
        Tasks(
            1,
            preempts=[9],
            aborts=[8],
            extensions=[Extension(7, [1])],
            chunks=[Chunk(6, 0, [1])],
            kv_sends=[KvSend(5, "d", 1, [1])],
        )
    )
    assert engine.has_runnable()
    report = step(engine)
    assert report.acked == [9, 8, 7, 6, 5] and report.handles == []
    assert engine.step() is None


def test_preempt_drops_and_acks_and_frees_the_slot_for_the_same_message() -> None:
    engine, sim = make_engine()
    start(engine, 1, place(1, slot=0))
    step(engine)
    engine.apply(
        Tasks(2, preempts=[1], placements=[place(2, slot=0)], chunks=[prompt_chunk(2, 0, 6)])
    )
    report = step(engine)
    assert report.acked == [1] and list(rows(report)) == [2]
    assert not engine.holds(1) and all(w.handle == 2 for w in sim.batches[-1])


def test_tasks_for_a_finished_handle_are_acked() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1, max_tokens=1))
    assert rows(step(engine))[1][2] == FinishReason.LENGTH
    engine.apply(Tasks(2, aborts=[1], extensions=[Extension(1, [3])]))
    assert step(engine).acked == [1]


def test_placement_conflicts_raise() -> None:
    engine, _ = make_engine()
    engine.apply(Tasks(1, placements=[place(1, slot=0)]))
    for bad in [place(1, slot=1), place(2, slot=0), place(3, slot=4), place(4, num_cached=6)]:
        with pytest.raises(ProtocolError):
            engine.apply(Tasks(2, placements=[bad]))


def test_reset_forgets_everything() -> None:
    engine, _ = make_engine()
    start(engine, 1, place(1))
    engine.reset()
    assert not engine.holds(1) and engine.step() is None


# ---- hand-off and KV push ---------------------------------------------------------------------


def test_handoff_placement_decodes_at_once() -> None:
    engine, sim = make_engine()
    p = place(1, prompt_len=8, num_cached=8, num_output=1, last_token=123, max_tokens=3)
    engine.apply(Tasks(1, placements=[p]))
    reports = run_until_idle(engine)
    assert sim.batches[0][0].token_ids == [123] and sim.batches[0][0].start == 8
    assert [rows(r)[1][0] for r in reports] == [9, 10]
    assert rows(reports[-1])[1][2] == FinishReason.LENGTH  # 1 earlier output + 2 new


def test_kv_send_runs_before_the_report_then_drops_the_handle() -> None:
    sent: list[tuple[KvSend, bytes]] = []
    sim = Recording()
    engine = WorkerEngine(sim, BLOCK, 4, EOS, 64, kv_sender=lambda s, d: sent.append((s, d)))
    send = KvSend(1, "decode-0", 42, [7, 8, 9, 10])
    p = place(1, prompt_len=6)
    engine.apply(Tasks(1, placements=[p], chunks=[prompt_chunk(1, 0, 4)], kv_sends=[send]))
    step(engine)
    assert sent == []
    engine.apply(Tasks(2, chunks=[prompt_chunk(1, 4, 6)]))
    report = step(engine)
    assert [s for s, _ in sent] == [send]
    assert rows(report) == {1: (6, [sim.token_at("req-1", 6)], FinishReason.NONE)}
    assert not engine.holds(1) and engine.step() is None
    SimExecutor().import_kv(send.dst_block_ids[:2], sent[0][1])  # 6 tokens fill 2 blocks
    with pytest.raises(ValueError):
        SimExecutor().import_kv(send.dst_block_ids, sent[0][1])


def _failing_sender(send: KvSend, data: bytes) -> None:
    raise ConnectionError("peer gone")


@pytest.mark.parametrize(
    ("sender", "dst_blocks"),
    [(_failing_sender, [1, 2]), (lambda s, d: None, [1]), (None, [1, 2])],
    ids=["sender-raises", "too-few-dst-blocks", "no-sender"],
)
def test_kv_send_failure_reports_failed(sender: object, dst_blocks: list[int]) -> None:
    engine = WorkerEngine(Recording(), BLOCK, 4, EOS, 64, kv_sender=sender)  # type: ignore[arg-type]
    p = place(1, prompt_len=6)
    send = KvSend(1, "decode-0", 42, dst_blocks)
    engine.apply(Tasks(1, placements=[p], chunks=[prompt_chunk(1, 0, 6)], kv_sends=[send]))
    report = step(engine)
    assert report.failed == [1] and list(rows(report)) == [1]
    assert not engine.holds(1)


# ---- speculative decoding ---------------------------------------------------------------------


def test_speculative_accepts_vary_and_never_overrun_block_room() -> None:
    engine, sim = make_engine(num_speculative_tokens=3, draft=lambda h, k: [7] * k)
    start(engine, 1, place(1, prompt_len=4, num_blocks=6))  # room for positions 0..23
    reports = run_until_idle(engine)
    assert reports[-1].paused == [1]
    decodes = [rows(r)[1] for r in reports[1:-1]]
    counts = [len(tokens) for _, tokens, _ in decodes]
    assert len(set(counts)) > 1 and all(1 <= c <= 4 for c in counts)
    assert all(comp <= 24 for comp, _, _ in decodes) and decodes[-1][0] == 24
    for b in sim.batches[1:]:
        w = b[0]
        assert w.start + w.num_draft < 24  # the positions written all lie in the table
    outputs = [t for _, tokens, _ in decodes for t in tokens]
    assert outputs == [sim.token_at("req-1", p) for p in range(5, 5 + len(outputs))]


def test_speculative_respects_max_tokens_and_stops_mid_draft() -> None:
    engine, _ = make_engine(num_speculative_tokens=4, draft=lambda h, k: [7] * k)
    start(engine, 1, place(1, max_tokens=7))
    outputs = [t for r in run_until_idle(engine) for t in rows(r)[1][1]]
    assert len(outputs) == 7
    engine, _ = make_engine(eos_every=3, num_speculative_tokens=4, draft=lambda h, k: [7] * k)
    for h in range(1, 5):
        start(engine, h, replace(place(h), req_id=f"eos-{h}"))
    for r in run_until_idle(engine):
        for _, tokens, reason in rows(r).values():
            assert EOS not in tokens[:-1]
            assert (tokens[-1] == EOS) == (reason is FinishReason.STOP)


def test_ngram_draft() -> None:
    assert ngram_draft([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert ngram_draft([1, 2, 3, 9, 2, 3, 5, 2, 3], 3) == [5, 2, 3]  # latest match wins
    assert ngram_draft([5, 1, 2, 9, 1, 2], 1) == [9]
    assert ngram_draft([1, 2, 3], 2) == []
    assert ngram_draft([1, 1], 0) == []


def test_default_draft_is_ngram() -> None:
    engine, sim = make_engine(num_speculative_tokens=2)
    engine.apply(
        Tasks(1, placements=[place(1, prompt_len=6)], chunks=[Chunk(1, 0, [1, 2, 3, 1, 2, 3])])
    )
    step(engine)
    first = sim.token_at("req-1", 6)
    step(engine)
    assert sim.batches[-1][0].token_ids[0] == first


# ---- rows an executor defers (the vLLM executor's steps launched ahead) -------------------------


class Deferring(Recording):
    """Defers every row the first time it is offered (by request and start)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int]] = set()

    def execute(self, work: list[SeqWork]) -> StepResult:
        later = [j for j, w in enumerate(work) if (w.req_id, w.start) not in self.seen]
        self.seen.update((w.req_id, w.start) for w in work)
        run = [w for j, w in enumerate(work) if j not in later]
        result = super().execute(run)
        tokens = iter(result.tokens)
        result.tokens = [[] if j in later else next(tokens) for j in range(len(work))]
        result.deferred = later or None
        return result


def test_deferred_rows_are_offered_again_and_change_no_token() -> None:
    """A deferred chunk stays queued and a deferred decode is offered again; neither advances
    nor reports: the tokens, and the reports' rows, are those of a run without deferral."""

    def run(sim: Recording) -> tuple[list[StepReport], WorkerEngine]:
        engine = WorkerEngine(sim, BLOCK, 4, EOS, 64)
        engine.apply(
            Tasks(
                1,
                placements=[place(1, prompt_len=10, max_tokens=5), place(2, max_tokens=4)],
                chunks=[prompt_chunk(1, 0, 4), prompt_chunk(1, 4, 10), prompt_chunk(2, 0, 6)],
            )
        )
        return [r for r in run_until_idle(engine) if r.handles], engine

    plain, _ = run(Recording())
    deferring = Deferring()
    late, engine = run(deferring)

    def outputs(reports: list[StepReport]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r in reports:
            for h, (_, tokens, _) in rows(r).items():
                out.setdefault(h, []).extend(tokens)
        return out

    assert outputs(late) == outputs(plain)
    assert [len(t) for t in outputs(late).values()] == [5, 4]
    assert engine.num_rows_deferred > 0
    assert engine.num_prefill_tokens == 16  # each chunk counted once, when it ran
    # every row (a chunk, a decode) was offered twice, run once: after its deferral
    ran = [(w.req_id, w.start) for b in deferring.batches for w in b]
    assert len(ran) == len(set(ran)) == len(deferring.seen)
