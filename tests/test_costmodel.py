"""The step-time fits of kvsched/data/README.md, at points computed by hand, and the sim's use."""

import pytest

from kvsched.core.protocol import SamplingParams
from kvsched.worker_stub.costmodel import step_time_s
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_stub.sim import SimExecutor


def ms(gpu: str, chunks: list[tuple[int, int]], contexts: list[int], drafts: int = 0) -> float:
    return step_time_s(gpu, chunks, contexts, drafts) * 1000.0


def test_h100_floor_and_decode_context() -> None:
    assert ms("h100", [], [0]) == pytest.approx(6.3)
    # 1 sequence, 1000 context tokens: floor + 4.9e-5 * 1000
    assert ms("h100", [], [1000]) == pytest.approx(6.3 + 0.049)


def test_h100_prefill_chunk() -> None:
    # N = 2048: 4.3 + 0.0211 * 2048 = 47.5128; attention 1.8e-6 * 2048 * 2048 = 7.5497
    assert ms("h100", [(2048, 0)], []) == pytest.approx(47.5128 + 7.5497472)


def test_h100_floor_crossover() -> None:
    # 4.3 + 0.0211 * N passes 6.3 at N = 94.8
    assert ms("h100", [(94, 10_000)], []) == pytest.approx(6.3 + 1.8e-6 * 94 * 10_094)
    assert ms("h100", [(95, 0)], []) == pytest.approx(4.3 + 0.0211 * 95 + 1.8e-6 * 95 * 95)


def test_a100_mixed_step() -> None:
    # chunk 512 after a 1024-token prefix, plus 100 decodes of 2000 context tokens: N = 612
    expected = 5.5 + 0.0666 * 612 + 0.6 + 8.0e-5 * 200_000 + 4.3e-6 * 512 * 1536
    assert ms("a100", [(512, 1024)], [2000] * 100) == pytest.approx(expected)


def test_a100_floor_and_overhead() -> None:
    assert ms("A100", [], [0]) == pytest.approx(10.5 + 0.6)


def test_draft_tokens_count_toward_n() -> None:
    base = ms("h100", [], [100] * 200)
    assert ms("h100", [], [100] * 200, drafts=600) == pytest.approx(base + 0.0211 * 600)


def test_empty_step_is_free_and_unknown_gpu_is_rejected() -> None:
    assert step_time_s("h100", [], []) == 0.0
    with pytest.raises(ValueError, match="h100"):
        step_time_s("v100", [], [1])


def _work(start: int, tokens: int, sample: bool, num_draft: int = 0) -> SeqWork:
    return SeqWork(1, "r", [0], start, [5] * tokens, sample, num_draft, SamplingParams())


def test_sim_classifies_decodes_and_chunks() -> None:
    sim = SimExecutor("h100")
    work = [_work(0, 512, False), _work(512, 100, True), _work(300, 1, True), _work(40, 4, True, 3)]
    expected = step_time_s("h100", [(512, 0), (100, 512)], [301, 44], 3)
    assert sim.execute(work).step_time_s == pytest.approx(expected)
    assert SimExecutor("h100", speed=2.0).execute(work).step_time_s == pytest.approx(expected / 2)
    assert SimExecutor("h100", zero_cost=True).execute(work).step_time_s == 0.0
