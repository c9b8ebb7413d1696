"""The event loop a long-running kvsched process (daemon, worker) runs on.

`KVSCHED_EVENT_LOOP`: `asyncio` (the standard library's loop), `uvloop` (libuv's, as vLLM's and
kvsched's HTTP servers run on through uvicorn; an error when uvloop is not installed) or `auto`
(uvloop when it is installed, else asyncio). gRPC's asyncio API runs on either: it wakes the loop
through a file descriptor the loop watches.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

ENV = "KVSCHED_EVENT_LOOP"
CHOICES = ("auto", "asyncio", "uvloop")
DEFAULT = "asyncio"


def factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for `choice` (default: the environment's, else DEFAULT); None for the
    standard library's loop. ValueError naming the variable for a bad value or a missing uvloop."""
    raw = os.environ.get(ENV, DEFAULT) if choice is None else choice
    if raw not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {raw!r}")
    if raw == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if raw == "uvloop":
            raise ValueError(
                f"{ENV}=uvloop but uvloop is not installed: pip install uvloop"
            ) from None
        return None
    new: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return new


def name() -> str:
    """The running loop's kind, for logs: "uvloop" or "asyncio"."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )
