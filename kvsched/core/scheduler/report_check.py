"""A worker's StepReport checked before anything changes (`ReportApplier.apply` calls it first):
its steps and applied seq in order, its columns of equal length and 64-bit, finish reasons
known, every handle it names issued. Returns the report's columns as arrays (`Columns`),
recognising the common report (one token per row, every handle on its slot) by comparing
bytes. Tuned like the rest of the report path (docs/BENCHMARKS.md).

Reads the placement table and the slot table; owns only its byte buffers. Imported by `report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import FinishReason, StepReport
from kvsched.core.scheduler.table import PlacementTable


@dataclass(slots=True)
class Columns:
    """A validated report's columns as arrays: handles, their slots (handle & mask), tokens;
    `row_tok` is the token of each one-token row, `one` marks those rows (None: all are),
    `match` marks rows whose handle is on its slot now (None: not computed). Made by the checker,
    then the applier's (it clears `match` when slots may have changed)."""

    h: np.ndarray
    s: np.ndarray
    toks: np.ndarray
    row_tok: np.ndarray | None = None
    one: np.ndarray | None = None
    match: np.ndarray | None = None
    all_match: bool = False  # every row's handle is on its slot (match not computed)
    fins: np.ndarray | None = None  # finish reasons; None: no row finished


class ReportChecker:
    """Validation of one instance's reports (owns the int64 ones / zeros it compares with)."""

    def __init__(self, table: PlacementTable) -> None:
        self._table = table
        self._slots = table.slots
        self._ones_bytes = b""  # int64 ones, as bytes
        self._zero_bytes = b""  # int64 zeros, as bytes

    def check(self, report: StepReport, last_step: int, last_applied_seq: int, seq: int) -> Columns:
        """Validate a report before anything changes (ProtocolError naming what is wrong);
        returns its columns as arrays. `last_step`, `last_applied_seq`: the last applied
        report's; `seq`: the last Tasks numbered."""
        if report.step <= last_step:
            raise ProtocolError(
                f"report for step {report.step} after step {last_step}: steps must increase"
            )
        if not last_applied_seq <= report.applied_seq <= seq:
            raise ProtocolError(
                f"report says it applied tasks {report.applied_seq}, but tasks "
                f"{last_applied_seq + 1}..{seq} are the only ones it could have"
            )
        n = len(report.handles)
        if not (len(report.num_computed) == len(report.num_new_tokens) == n):
            raise ProtocolError(
                "report columns handles/num_computed/num_new_tokens differ in length"
            )
        fins = report.finish_reasons
        if len(fins) and len(fins) != n:
            raise ProtocolError("report column finish_reasons must be empty or one per handle")
        fin: np.ndarray | None = None  # None: no row finished (the common report)
        if len(fins):
            fin = np.asarray(fins, dtype=np.int64)
            if 8 * n > len(self._zero_bytes):
                self._zero_bytes = bytes(16 * n)
            if fin.tobytes() == self._zero_bytes[: 8 * n]:
                fin = None
            elif not 0 <= int(fin.min()) <= int(fin.max()) <= FinishReason.ERROR:
                raise ProtocolError("report has an unknown finish reason")
        try:
            toks = np.asarray(report.token_ids, dtype=np.int64)
            h = np.asarray(report.handles, dtype=np.int64)
            nums = np.asarray(report.num_new_tokens, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as exc:
            raise ProtocolError(f"report columns must be 64-bit integers: {exc}") from None
        cols = Columns(h, h & self._slots.mask, toks)
        if n:
            # The common report (every row one token, every handle on its slot) is recognised
            # by comparing bytes: after the worker's conversion numpy's ufunc machinery is cold
            # in the CPU's caches (~2 us a call), a memcmp is not.
            ones = self._ones_bytes
            if len(ones) < 8 * n:
                ones = self._ones_bytes = np.ones(2 * n, dtype=np.int64).tobytes()
            if len(toks) == n and nums.tobytes() == ones[: 8 * n]:
                cols.row_tok = toks  # every row sampled exactly one token: row i has toks[i]
            else:
                if int(nums.min()) < 0:
                    raise ProtocolError("report has a negative token count")
                if int(nums.sum()) != len(toks):
                    raise ProtocolError("report token_ids length != sum(num_new_tokens)")
                cols.one = nums == 1
                cols.row_tok = toks.take(np.cumsum(nums) - 1, mode="clip") if len(toks) else nums
            # A handle on its slot was issued; only the others need the range check.
            on_slot = self._slots.handle[cols.s]
            if on_slot.tobytes() == h.tobytes():
                # An empty slot holds -1: a row naming -1 (or any handle below the first one
                # issued) would match it.
                if int(h.min()) < self._table.first_handle:
                    self._check_handles(h)  # raises
                cols.all_match = True
            else:
                cols.match = match = on_slot == h
                self._check_handles(h[~match])
        elif len(toks):
            raise ProtocolError("report token_ids length != sum(num_new_tokens)")
        for col in (
            report.acked,
            report.paused,
            report.failed,
            report.failed_swap_ins,
            report.failed_storage_fetches,
        ):
            if len(col):
                self._check_handles(col)
        cols.fins = fin
        return cols

    def _check_handles(self, handles: Any) -> None:
        try:
            handles = np.asarray(handles, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ProtocolError("report names a handle that is not a 64-bit integer") from None
        first, next_handle = self._table.first_handle, self._table.next_handle
        if len(handles) and (int(handles.min()) < first or int(handles.max()) >= next_handle):
            raise ProtocolError(
                f"report names handle(s) never issued (issued so far: {first}..{next_handle - 1})"
            )
