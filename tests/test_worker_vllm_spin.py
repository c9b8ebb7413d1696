"""How the vLLM worker's shared-memory readers wait (kvsched/worker_vllm/spin.py): they spin as
vLLM has them while steps are small and a read was recent, and nap otherwise. No vLLM needed:
the wait is driven with a stand-in for vLLM's SpinCondition (its two fields the wait reads)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvsched.worker_vllm import spin


def _wait(cond: SimpleNamespace) -> list[int | None]:
    """One wait of a reader; the calls that reached vLLM's own wait."""
    calls: list[int | None] = []
    spin._napping_wait(cond, 1e-6, calls.append, 7)
    return calls


def _cond(read_ago_s: float) -> SimpleNamespace:
    return SimpleNamespace(last_read=time.monotonic() - read_ago_s, busy_loop_s=1.0)


@pytest.fixture(autouse=True)
def _reset() -> None:
    spin.note_batch(0, 0)


def test_small_steps_spin_with_vllms_own_wait_right_after_a_read() -> None:
    spin.note_batch(2, 2)
    assert _wait(_cond(0.0)) == [7]


def test_large_steps_nap_instead() -> None:
    spin.note_batch(3, 2)
    assert _wait(_cond(0.0)) == []


def test_an_idle_reader_stops_spinning_after_the_window() -> None:
    spin.note_batch(1, 2)
    assert _wait(_cond(spin.SPIN_WINDOW_S * 4)) == []


def test_spin_batch_zero_always_naps() -> None:
    spin.note_batch(1, 0)
    assert _wait(_cond(0.0)) == []


def test_past_vllms_busy_window_vllm_waits_on_its_notification() -> None:
    spin.note_batch(5, 2)
    assert _wait(_cond(2.0)) == [7]


def test_child_hook_notes_each_step_before_it_runs() -> None:
    seen: list[bool] = []
    worker = SimpleNamespace(execute_model=lambda out: seen.append(spin._small_step[0]) or "ok")
    spin.watch_batches(worker, 2)
    assert worker.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 1})) == "ok"
    assert worker.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, "c": 1}))
    assert seen == [True, False]


@pytest.mark.parametrize("raw", ["-1", "x", "70000"])
def test_bad_spin_batch_is_refused_with_the_variable_named(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(spin.SPIN_ENV, raw)
    with pytest.raises(ValueError, match=spin.SPIN_ENV):
        spin.spin_batch()


def test_spinning_small_steps_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(spin.SPIN_ENV, raising=False)
    assert spin.spin_batch() == 0
    monkeypatch.setenv(spin.SPIN_ENV, "2")
    assert spin.spin_batch() == 2
