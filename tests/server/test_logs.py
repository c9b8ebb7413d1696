"""setup_logging (text and JSON lines) and request_logger (request_id on every line)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvsched.core.errors import ConfigError
from kvsched.server.telemetry.logs import request_logger, setup_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    out = io.StringIO()
    yield out
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_json_lines_carry_fields_and_extras(stream: io.StringIO) -> None:
    setup_logging("info", json=True, stream=stream)
    logging.getLogger("kvsched.test").info(
        "scheduled %d tokens", 42, extra={"instance": "i0", "step": 7}
    )
    (line,) = lines(stream)
    record = json.loads(line)
    assert record["level"] == "info"
    assert record["logger"] == "kvsched.test"
    assert record["msg"] == "scheduled 42 tokens"
    assert record["instance"] == "i0" and record["step"] == 7
    assert record["ts"].endswith("Z") and "T" in record["ts"]


def test_request_logger_puts_request_id_on_every_line(stream: io.StringIO) -> None:
    setup_logging("debug", json=True, stream=stream)
    rlog = request_logger("req-1", instance="i0")
    rlog.debug("queued at position %d", 3)
    rlog.info("finished %s", "stop", extra={"num_tokens": 12})
    first, second = (json.loads(line) for line in lines(stream))
    assert first["request_id"] == second["request_id"] == "req-1"
    assert first["instance"] == second["instance"] == "i0"
    assert first["msg"] == "queued at position 3"
    assert second["num_tokens"] == 12  # a call's own extra is kept, not dropped
    assert first["logger"] == "kvsched.request"


def test_request_logger_on_a_given_logger(stream: io.StringIO) -> None:
    setup_logging("info", json=False, stream=stream)
    request_logger("r2", logging.getLogger("kvsched.engine")).warning("preempted")
    (line,) = lines(stream)
    assert "WARNING kvsched.engine: preempted request_id=r2" in line


def test_text_format_and_exception(stream: io.StringIO) -> None:
    setup_logging("info", json=False, stream=stream)
    log = logging.getLogger("kvsched.test")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("step failed", extra={"instance": "i1"})
    text = stream.getvalue()
    assert "ERROR   kvsched.test: step failed instance=i1" in text
    assert "Traceback" in text and "ValueError: boom" in text


def test_json_exception_is_one_line(stream: io.StringIO) -> None:
    setup_logging("info", json=True, stream=stream)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("kvsched.test").exception("failed")
    (line,) = lines(stream)
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_level_filters_and_args_are_not_formatted_when_disabled(stream: io.StringIO) -> None:
    setup_logging("warning", json=True, stream=stream)

    class Explodes:
        def __str__(self) -> str:
            raise AssertionError("formatted although the level is disabled")

    request_logger("r3").debug("tokens %s", Explodes())
    logging.getLogger("kvsched.test").info("hidden %s", Explodes())
    assert lines(stream) == []


def test_setup_is_idempotent_and_replaces_itself(stream: io.StringIO) -> None:
    setup_logging("info", json=False, stream=io.StringIO())
    setup_logging("info", json=True, stream=stream)
    logging.getLogger("kvsched.test").info("once")
    assert len(lines(stream)) == 1
    assert json.loads(lines(stream)[0])["msg"] == "once"


def test_non_json_values_are_stringified(stream: io.StringIO) -> None:
    setup_logging("info", json=True, stream=stream)
    logging.getLogger("kvsched.test").info("x", extra={"blocks": {1, 2}.__class__})
    assert json.loads(lines(stream)[0])["blocks"] == "<class 'set'>"


def test_bad_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="log_level = 'loud'"):
        setup_logging("loud")
