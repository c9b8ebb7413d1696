"""`kvsched http`'s command line: registered in kvsched's CLI, bad arguments are one line on
stderr and exit 2 (no traceback, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsched.cli import build_parser, main


def test_http_is_a_kvsched_subcommand() -> None:
    args = build_parser().parse_args(["http", "--model", "D", "--served-model-name", "a"])
    assert (args.listen, args.server, args.served_model_name) == (
        "127.0.0.1:8000",
        "127.0.0.1:50051",
        ["a"],
    )


def test_bad_arguments_exit_2_with_one_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["http", "--model", str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["http", "--model", str(model_dir), "--listen", "8000"]) == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["http", "--model", str(tmp_path / "empty"), "--listen", "127.0.0.1:0"]) == 2
    assert capsys.readouterr().err.endswith("no tokenizer.json (a fast tokenizer)\n")
    (tmp_path / "empty" / "tokenizer.json").write_text("{not json")
    assert main(["http", "--model", str(tmp_path / "empty"), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsched http: ") and err.count("\n") == 1
