"""The operator's command line (issue 24): every option has help and shows its default,
`--version`, `kvsched generate` (ids and text), `kvsched status` shows lost instances and forgets
them, unknown KVSCHED_* variables are warned about, every unknown TOML key is reported at once,
a worker that reaches no daemon says so once and gives up when told to, and a port in use is
said before gRPC's own noise. Real processes on loopback where a process is what the user runs."""

from __future__ import annotations

import argparse
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvsched import __version__, cli
from kvsched.core.errors import ConfigError
from kvsched.server.config.load import load_config
from tests.integration.harness import (
    REPO,
    Proc,
    child_env,
    start_daemon,
    start_worker,
    status,
    wait_ready,
)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_option_has_help_that_shows_its_default() -> None:
    parser = cli.build_parser()
    missing = []
    for name, sub in _subparsers(parser).items():
        formatter = sub.formatter_class(prog=f"kvsched {name}")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = formatter._get_help_string(action) or ""
            if not action.help or "default" not in text.lower():
                missing.append(f"{name} {'/'.join(action.option_strings)}: {text!r}")
    assert not missing, "\n".join(missing)


def test_help_never_shows_a_token(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("KVSCHED_TOKEN", "s3cret-token")
    for name in ("worker", "status", "generate"):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        assert "s3cret-token" not in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvsched {__version__}"


def _kvsched(*args: str, timeout: float = 60, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kvsched.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def daemon_and_worker():
    daemon, address = start_daemon(env={"KVSCHED_FORGET_LOST_INSTANCE_S": "3"})
    worker = start_worker(address, "i0", "--zero-cost")
    try:
        wait_ready(address, ["i0"])
        yield daemon, worker, address
    finally:
        worker.stop()
        daemon.stop()


def test_generate_ids(daemon_and_worker) -> None:
    _, _, address = daemon_and_worker
    got = _kvsched("generate", "--server", address, "5, 6 7", "--max-tokens", "5")
    assert got.returncode == 0, got.stderr
    ids_line, finished = got.stdout.strip().splitlines()
    assert len(ids_line.split()) == 5 and all(t.isdigit() for t in ids_line.split())
    assert finished.startswith("finished: length")
    assert "prompt 3 tokens" in finished and "output 5" in finished


def test_generate_refused_and_bad_prompt(daemon_and_worker) -> None:
    _, _, address = daemon_and_worker
    got = _kvsched("generate", "--server", address, "1 2", "--model", "nope")
    assert got.returncode == 1
    assert "NOT_FOUND" in got.stderr and "nope" in got.stderr
    got = _kvsched("generate", "--server", address, "hello there")
    assert got.returncode == 2
    assert "--tokenizer" in got.stderr


def _word_tokenizer(where: Path) -> Path:
    """A word-level tokenizer over 32,000 made-up words (the sim's vocabulary size), built
    offline with `tokenizers` and saved as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"w{i}": i for i in range(3, 32000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(where)
    return where


def test_generate_text_with_a_tokenizer(daemon_and_worker, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _, _, address = daemon_and_worker
    tok = _word_tokenizer(tmp_path / "tok")
    got = _kvsched(
        "generate", "--server", address, "--tokenizer", str(tok), "hello world",
        "--max-tokens", "4",
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    text, finished = got.stdout.strip().splitlines()
    words = text.split()
    assert len(words) == 4 and all(w.startswith("w") or w in ("hello", "world") for w in words)
    assert "prompt 2 tokens" in finished


def test_status_shows_a_lost_instance_then_forgets_it(daemon_and_worker) -> None:
    _, _, address = daemon_and_worker
    extra = start_worker(address, "gone", "--zero-cost")
    wait_ready(address, ["gone"])
    extra.stop()
    deadline = time.monotonic() + 30
    seen_lost = False
    while time.monotonic() < deadline:
        got = _kvsched("status", "--server", address)
        rows = {ln.split()[0]: ln for ln in got.stdout.splitlines() if ln.strip()}
        if "gone" in rows and " lost " in rows["gone"]:
            seen_lost = True
        if seen_lost and "gone" not in rows:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"lost seen: {seen_lost}; last status:\n{got.stdout}")
    assert [i.instance_id for i in status(address).instances] == ["i0"]


def test_unknown_env_variable_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    env = {"KVSCHED_LISTN": "127.0.0.1:1", "KVSCHED_TOKEN": "t", "KVSCHED_TRACE_DIR": "/x"}
    with caplog.at_level(logging.WARNING, logger="kvsched.config"):
        load_config(None, env, {})
    (line,) = [r.getMessage() for r in caplog.records]
    assert "KVSCHED_LISTN" in line and "KVSCHED_LISTEN" in line


def test_every_unknown_toml_key_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'listenn = "x"\ngrace_period = 3\n[engine.scheduler]\nmax_num_seqz = 3\n'
        "[instances.a.cache]\nblok_size = 3\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(str(path), {}, {})
    msg = str(e.value)
    assert "4 unknown key(s)" in msg
    for part in ("'listenn'", "'listen'", "'grace_period'", "engine.scheduler.max_num_seqz",
                 "max_num_seqs", "instances.a.cache.blok_size", "block_size"):  # fmt: skip
        assert part in msg, part


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_worker_that_reaches_no_daemon_says_so_once_and_gives_up() -> None:
    port = _closed_port()
    w = Proc(
        ["worker", "--server", f"127.0.0.1:{port}", "--give-up-after", "3",
         "--reconnect-max-s", "0.5"],
        name="worker",
    )  # fmt: skip
    assert w.wait(60) == 1
    lines = w.lines
    assert sum("cannot reach any daemon" in ln for ln in lines) == 1, "\n".join(lines)
    assert any("giving up" in ln and "3 s" in ln for ln in lines)
    assert not any("WARNING" in ln for ln in lines), "\n".join(lines)
    assert any(" 0 connects" in ln for ln in lines)


def test_port_in_use_is_said_first_in_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        got = _kvsched("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off")
    assert got.returncode != 0
    first = (got.stderr + got.stdout).strip().splitlines()[0]
    assert "address already in use" in first and str(port) in first
