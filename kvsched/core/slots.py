"""Per-slot arrays for the decode hot path: a steady decode step costs a few vectorized numpy
operations, not a Python loop over the running requests.

    handle[s]   the handle placed on slot s (-1: none). Handles are issued so that
                handle & mask == slot, so a report's handle column maps to slots by arithmetic,
                and a row whose handle no longer matches its slot (a late row about a finished
                or preempted occupant) is told apart by one comparison.
    n_out[s]    output tokens of slot s's request, counting tokens not yet moved to the request.
    check[s]    n_out at which the request next needs the scheduler (Request.check_out).
    ring[s, :]  the last RING output tokens of slot s, by output position modulo RING.

A plain decode row (one sampled token) only writes ring and n_out. The request's own list
(`Request.output_token_ids`) catches up from the ring whenever it is read (`sync`); the
scheduler keeps every request's check within RING tokens of its last sync, so the ring never
overwrites a token that was not moved yet.

Invariant while a request is bound to its slot: n_out[slot] >= len(req._out), and the tokens at
positions len(req._out) .. n_out[slot]-1 are in ring[slot]. Whoever appends to req._out directly
calls `rebase` (or writes n_out) so the invariant holds again.
"""

from __future__ import annotations

import numpy as np

from kvsched.core.request import Request

RING = 256  # tokens a slot may decode between two visits of the scheduler (a power of two)
RING_SHIFT = RING.bit_length() - 1


# ---- a request's tokens: written here only -----------------------------------------------
# (tests/test_layout_owners.py: no other module writes a request's token fields or reads its
# private ones; the scheduler's report, roles and exits, the daemon's copies and relays call
# these.)


def current(req: Request) -> tuple[list[int], int]:
    """req's output tokens and the KV positions the worker reported written, with the tokens
    waiting in its slot's ring moved to it first. The list is req's own: read it, don't keep
    it past the next write."""
    rows = req._rows
    if rows is not None:
        rows.sync(req)
    return req._out, req._reported


def set_output(req: Request, tokens: list[int]) -> None:
    """req's output is `tokens` (a copy placed anew, a hand-off's first tokens, the tokens a
    resumed request's client already holds)."""
    req._out = list(tokens)
    if req._rows is not None:
        req._rows.rebase(req)


def extend_output(req: Request, tokens: list[int]) -> None:
    """Append `tokens` to req's output (a report row's sampled tokens, tokens a peer relayed),
    after those waiting in its ring."""
    rows = req._rows
    if rows is not None:
        rows.sync(req)
    req._out.extend(tokens)
    if rows is not None:
        rows.rebase(req)


def packed_output(req: Request, start: int, end: int) -> bytes | None:
    """Output tokens [start, end) of req as little-endian int64 bytes, read from its slot's
    ring; None when it is on no slot or some of them are not there."""
    rows = req._rows
    return None if rows is None else rows.packed(req, start, end)


def set_reported(req: Request, n: int) -> None:
    """The worker has written req's KV up to position n (0: nothing of this placement)."""
    if req._rows is not None:
        req._rows.sync(req)
    req._reported = n


class SlotTable:
    """The per-slot arrays; implements `request.TokenSource` for the requests bound to it."""

    def __init__(self, num_slots: int) -> None:
        self.size = 1 << max(0, (num_slots - 1).bit_length())
        self.mask = self.size - 1
        self.handle = np.full(self.size, -1, dtype=np.int64)
        self.n_out = np.zeros(self.size, dtype=np.int64)
        self.check = np.zeros(self.size, dtype=np.int64)
        self.ring = np.zeros((self.size, RING), dtype="<i8")  # little-endian: hashed as bytes
        self.ring_flat = self.ring.reshape(-1)  # the same memory: slot s, position i at s*RING+i
        # Output count from which every token of slot s went through the ring (tokens appended
        # to the request directly, by slow rows, are not in it).
        self.ring_from = np.zeros(self.size, dtype=np.int64)
        self.reqs: list[Request | None] = [None] * self.size
        self._snapshot: list[Request | None] | None = None  # a copy of reqs, None: stale
        self.epoch = 0  # bumped by every vectorized write (`written`)
        self._mark = np.zeros(self.size, dtype=np.int64)
        self._order = np.arange(self.size, dtype=np.int64)

    def handle_for(self, slot: int, at_least: int) -> int:
        """The smallest handle >= at_least that maps to `slot`."""
        return at_least + ((slot - at_least) & self.mask)

    def bind(self, req: Request) -> None:
        """Put req (its handle and slot already set) on its slot; check 0 sends its first row
        through the scheduler's slow path."""
        if req._rows is not None:
            req._rows.unbind(req)
        s = req.slot
        self.handle[s] = req.handle
        self.n_out[s] = self.ring_from[s] = len(req._out)
        self.check[s] = req.check_out = 0
        self.reqs[s] = req
        self._snapshot = None
        req._rows = self
        req._epoch = -1

    def unbind(self, req: Request) -> None:
        """Take req off its slot, its tokens moved to the request first."""
        self.sync(req)
        s = req.slot
        if self.reqs[s] is req:
            self.handle[s] = -1
            self.reqs[s] = None
            self._snapshot = None
        req._rows = None

    def sync(self, req: Request) -> None:
        """Move the tokens of plain decode rows from the ring to req; the worker has written the
        KV of every token but the newest (each came from a decode row), so num_reported follows.
        Free when nothing was written since req's last sync (one comparison of epochs)."""
        if req._epoch == self.epoch:
            return
        req._epoch = self.epoch
        s = req.slot
        n = int(self.n_out[s])
        out = req._out
        m = len(out)
        if n > m:
            for part in self._stretches(s, m, n):
                out.extend(part.tolist())
            req._reported = len(req.prompt_token_ids) + n - 1

    def packed(self, req: Request, start: int, end: int) -> bytes | None:
        """Output tokens [start, end) of req (bound here) as little-endian int64 bytes, read
        from the ring; None when some of them are not there (older, or appended directly)."""
        s = req.slot
        n = int(self.n_out[s])
        if start < n - RING or end > n or start >= end or start < int(self.ring_from[s]):
            return None
        return b"".join([part.tobytes() for part in self._stretches(s, start, end)])

    def _stretches(self, s: int, start: int, end: int) -> tuple[np.ndarray, ...]:
        """Ring slot s's tokens for output positions [start, end) (0 < end - start <= RING):
        one slice of its row, two when they wrap."""
        a, b = start & (RING - 1), end & (RING - 1)
        row = self.ring[s]
        return (row[a:b],) if a < b else (row[a:], row[:b])

    def snapshot(self) -> list[Request | None]:
        """`reqs` as it is now, in a list nobody changes (shared until a slot changes hands):
        what a columnar token delta names its requests by."""
        snap = self._snapshot
        if snap is None:
            snap = self._snapshot = self.reqs.copy()
        return snap

    def written(self) -> None:
        """The hot path wrote ring / n_out: every request may have tokens to move again."""
        self.epoch += 1

    def rebase(self, req: Request) -> None:
        """req._out was changed directly: make the slot's count agree."""
        self.n_out[req.slot] = self.ring_from[req.slot] = len(req._out)

    def set_check(self, req: Request, check_out: int) -> None:
        """Record the output count at which req next needs the scheduler, capped so the ring
        never wraps past tokens still to be moved."""
        cap = len(req._out) + RING
        req.check_out = check_out if check_out < cap else cap
        self.check[req.slot] = req.check_out

    def check_bound(self, req: Request, ring: int) -> None:
        """Integrity: req is bound to its slot row, its handle maps to it, at most `ring`
        output tokens wait in the ring, and the slot's check is the request's."""
        s = req.slot
        assert self.reqs[s] is req and req._rows is self, f"{req.req_id}: slot row unbound"
        assert int(self.handle[s]) == req.handle and req.handle & self.mask == s
        lag = int(self.n_out[s]) - len(req._out)
        assert 0 <= lag <= ring, f"{req.req_id}: {lag} output tokens in the ring"
        assert int(self.check[s]) == req.check_out, f"{req.req_id}: slot check drifted"

    def rounds(self, s: np.ndarray, h: np.ndarray) -> list[np.ndarray | None]:
        """Split report rows into rounds in which no handle appears twice, keeping each
        handle's rows in order: [None] (all rows, one round) unless some slot is named twice."""
        n = len(s)
        if n < 2:
            return [None]
        if len(self._order) < n:
            self._order = np.arange(2 * n, dtype=np.int64)
        order = self._order[:n]
        mark = self._mark
        mark[s] = order
        if mark[s].tobytes() == order.tobytes():  # (bytes: no cold ufunc, see report_check)
            return [None]
        by_handle = np.argsort(h, kind="stable")
        sh = h[by_handle]
        starts = np.zeros(n, dtype=np.int64)
        starts[1:] = np.where(sh[1:] != sh[:-1], order[1:], 0)
        rank = np.empty(n, dtype=np.int64)
        rank[by_handle] = order - np.maximum.accumulate(starts)
        by_rank = np.argsort(rank, kind="stable")  # rows of round 0, then round 1, ...
        return list(np.split(by_rank, np.cumsum(np.bincount(rank))[:-1]))
