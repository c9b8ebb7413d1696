"""`kvsched worker --executor vllm`: arguments it refuses before loading anything, with a message
naming what to fix (exit 2). Runs in the main virtualenv, where vLLM is absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvsched import cli


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["worker", "--server", "127.0.0.1:1", "--executor", "vllm", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_vllm_needs_a_model_directory(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    code, _ = _run(capsys)
    assert code == 2
    assert "--executor vllm needs --model DIR" in caplog.text
    code, _ = _run(capsys, "--model", str(tmp_path / "absent"))
    assert code == 2
    assert "is not a directory" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_missing_names_the_extra(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    code, _ = _run(capsys, "--model", str(tmp_path))
    assert code == 2
    assert "pip install 'kvsched[vllm]'" in caplog.text
