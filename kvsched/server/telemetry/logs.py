"""Structured logs: text or JSON lines on stderr, with request ids on every line about a request.

    setup_logging("info", json=True)
    rlog = request_logger(req_id, instance="i0")
    rlog.info("finished %s after %d tokens", reason, num_tokens)
    -> {"ts": "...Z", "level": "info", "logger": "kvsched.request", "msg": "finished stop after
        12 tokens", "request_id": "r1", "instance": "i0"}

Hot paths log with %-style arguments, never f-strings: the message is built only if the level is
enabled (`Logger.debug` checks before formatting; so does the adapter below).
"""

from __future__ import annotations

import json as _json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from datetime import UTC, datetime
from typing import Any, TextIO

from kvsched.core.errors import ConfigError

__all__ = ["JsonFormatter", "RequestLogger", "TextFormatter", "request_logger", "setup_logging"]

REQUEST_LOGGER = "kvsched.request"

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


def _timestamp(record: logging.LogRecord) -> str:
    ts = datetime.fromtimestamp(record.created, tz=UTC)
    return ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, `extra` fields, exc (a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return _json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger: msg key=value ...` with the `extra` fields at the end."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{_timestamp(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


class _KvschedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler `setup_logging` installed, so that calling it again replaces it."""


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _parse_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = _LEVELS.get(level.strip().lower())
    if value is None:
        raise ConfigError(
            f"log_level = {level!r}; expected one of debug, info, warning, error, critical"
        )
    return value


def setup_logging(
    level: str | int = "info", json: bool = False, stream: TextIO | None = None
) -> None:
    """Log to `stream` (stderr) at `level`, as JSON lines or text. Idempotent: replaces itself."""
    value = _parse_level(level)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _KvschedHandler)]:
        root.removeHandler(old)
    handler = _KvschedHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root.addHandler(handler)
    root.setLevel(value)


class RequestLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger whose every line carries `request_id` (and any other fixed fields).

    Unlike the stdlib adapter, a call's own `extra` is merged with the fixed fields, not dropped.
    """

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        own = kwargs.get("extra")
        fixed: Mapping[str, Any] = self.extra or {}
        kwargs["extra"] = {**fixed, **own} if own else fixed
        return msg, kwargs


def request_logger(
    req_id: str, logger: logging.Logger | None = None, **fields: Any
) -> RequestLogger:
    """A logger for lines about request `req_id`; `fields` (e.g. instance="i0") go on every line."""
    return RequestLogger(
        logger or logging.getLogger(REQUEST_LOGGER), {"request_id": req_id, **fields}
    )
