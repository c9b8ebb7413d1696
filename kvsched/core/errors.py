"""Typed errors raised at the core's boundary. The server maps each to one gRPC status code."""

from __future__ import annotations

from typing import Any


class KvschedError(Exception):
    """Base of every error kvsched raises on purpose."""


class ConfigError(KvschedError, ValueError):
    """A configuration value is out of range; the message names the field and the allowed range."""


class InvalidRequest(KvschedError, ValueError):
    """A request cannot be accepted as given (INVALID_ARGUMENT)."""


class RequestAlreadyLive(InvalidRequest):
    """A new request whose id a live request holds that has the same model and prompt: the same
    request sent again (INVALID_ARGUMENT, like any id in use). Its type travels in the status's
    trailing metadata, so a forwarding daemon whose earlier forward reached the peer follows
    that request there by Resume instead of ending it; an id reused with another prompt is a
    plain InvalidRequest."""


class RequestNotFound(KvschedError, KeyError):
    """No live request has this id (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "request not found"


class CapacityExceeded(KvschedError):
    """The waiting queue is full (RESOURCE_EXHAUSTED)."""


class ProtocolError(KvschedError):
    """A worker broke the protocol: unknown handle, report for a step never sent (FAILED_PRECONDITION)."""


class Unavailable(KvschedError):
    """The daemon or instance is not accepting work now: draining, no instance ready (UNAVAILABLE)."""


class AdoptIncomplete(Unavailable):
    """A takeover of a dead daemon's journal won `won` (its records of those requests) but not
    the rest: the journal failed (UNAVAILABLE). The caller keeps those won; the next pass
    takes the others, whose records stay under the dead daemon."""

    def __init__(self, won: list[Any], cause: BaseException) -> None:
        super().__init__(f"takeover incomplete ({len(won)} request(s) won): {cause!r}")
        self.won = won
        self.cause = cause
