"""A request's state in the daemon's journal, as a value both sides name: the server's request
record holds it, the journal (kvsched.durability) is its only writer. Pure: no I/O."""

from __future__ import annotations

import enum


class JournalState(enum.IntEnum):
    """NONE: not journaled (no journal, or it runs on a peer's instance: that peer journals
    it); IN_FLIGHT: its accepted record was sent, not yet acknowledged; STORED: acknowledged
    (token batches follow); CLOSED: its finished record is written."""

    NONE = 0
    IN_FLIGHT = 1
    STORED = 2
    CLOSED = 3
