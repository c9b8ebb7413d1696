"""KVSCHED_EVENT_LOOP: which event loop the daemon and the worker run on (kvsched/event_loop.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvsched import event_loop


def test_asyncio_is_the_default_and_the_standard_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.factory() is None
    assert event_loop.factory("asyncio") is None


def test_uvloop_runs_a_coroutine_and_names_itself() -> None:
    pytest.importorskip("uvloop")  # the dev extra installs it (not on Windows)
    new = event_loop.factory("uvloop")
    assert new is not None
    with asyncio.Runner(loop_factory=new) as runner:

        async def which() -> str:
            await asyncio.sleep(0)
            return event_loop.name()

        assert runner.run(which()) == "uvloop"
    with asyncio.Runner(loop_factory=event_loop.factory("asyncio")) as runner:
        assert runner.run(which()) == "asyncio"


def test_a_bad_value_names_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "tokio")
    with pytest.raises(
        ValueError, match=r"KVSCHED_EVENT_LOOP must be one of auto, asyncio, uvloop"
    ):
        event_loop.factory()


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop.factory("auto") is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop.factory("uvloop")
