"""The numbers a worker keeps per slot, as numpy columns: one decode step over R slots is a few
vectorized operations instead of R Python calls.

Index i of every column is slot i. A column's value means something only while `occupied[i]`;
`decoding[i]` marks occupants whose prompt is done (they decode on their own, step 5 of the WorkerService comment in worker_service.proto), and
whose newest token `last_token[i]` has no KV yet. A decoding slot runs while it has room for the
position it writes: `num_computed < capacity`, capacity = len(block table) x block_size.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvsched.core.protocol import FinishReason, SamplingParams

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_NONE, _STOP, _LENGTH = int(FinishReason.NONE), int(FinishReason.STOP), int(FinishReason.LENGTH)


class SlotTable:
    """Per-slot counters and stop conditions of the handles a worker holds."""

    def __init__(self, num_slots: int) -> None:
        n = num_slots
        self.occupied = np.zeros(n, np.bool_)
        self.decoding = np.zeros(n, np.bool_)
        self.paused = np.zeros(n, np.bool_)  # reported as lacking room; cleared by an extension
        self.handle = np.zeros(n, np.int64)
        self.num_computed = np.zeros(n, np.int64)  # positions [0, num_computed) have KV
        self.capacity = np.zeros(n, np.int64)
        self.num_output = np.zeros(n, np.int64)
        self.last_token = np.zeros(n, np.int64)
        self.max_tokens = np.zeros(n, np.int64)
        self.min_tokens = np.zeros(n, np.int64)
        self.ignore_eos = np.zeros(n, np.bool_)
        self.key = np.zeros(n, np.uint64)  # the executor's key of the request (columnar sim)
        self._stop_ids: dict[int, list[int]] = {}  # slot -> stop token ids, where any
        self._stop_pairs: IntArray | None = None  # sorted slot << 32 | token; None: rebuild

    def occupy(self, slot: int, handle: int, sampling: SamplingParams, key: int) -> None:
        self.occupied[slot] = True
        self.decoding[slot] = self.paused[slot] = False
        self.handle[slot] = handle
        self.max_tokens[slot] = sampling.max_tokens
        self.min_tokens[slot] = sampling.min_tokens
        self.ignore_eos[slot] = sampling.ignore_eos
        self.key[slot] = key
        if sampling.stop_token_ids or slot in self._stop_ids:
            self._stop_ids.pop(slot, None)
            if sampling.stop_token_ids:
                self._stop_ids[slot] = list(sampling.stop_token_ids)
            self._stop_pairs = None

    def vacate(self, slot: int) -> None:
        self.occupied[slot] = self.decoding[slot] = self.paused[slot] = False
        if self._stop_ids.pop(slot, None) is not None:
            self._stop_pairs = None

    def clear(self) -> None:
        for column in (self.occupied, self.decoding, self.paused):
            column[:] = False
        self._stop_ids.clear()
        self._stop_pairs = None

    # ---- queries over all slots, vectorized --------------------------------------------------

    def decode_runnable(self) -> BoolArray:
        return self.decoding & (self.num_computed < self.capacity)

    def any_decode_news(self) -> bool:
        """A decoding slot can run, or newly lacks room (to be reported paused)."""
        return bool(np.any(self.decoding & ((self.num_computed < self.capacity) | ~self.paused)))

    def take_newly_blocked(self) -> IntArray:
        """Slots of decoding handles that newly lack room; marks them paused."""
        blocked = np.flatnonzero(
            self.decoding & (self.num_computed >= self.capacity) & ~self.paused
        )
        self.paused[blocked] = True
        return blocked

    # ---- one plain decode (no drafts) per slot ------------------------------------------------

    def stop_reasons(
        self, slots: IntArray, tokens: IntArray, eos_token_id: int, max_model_len: int
    ) -> IntArray:
        """FinishReason per slot after it sampled tokens[i] at position num_computed + 1, as
        `check_stop` decides for one token: length first, then EOS / stop ids past min_tokens."""
        out = self.num_output[slots] + 1
        length = (out >= self.max_tokens[slots]) | (self.num_computed[slots] + 2 >= max_model_len)
        stops = (tokens == eos_token_id) & ~self.ignore_eos[slots]
        if self._stop_ids:
            pairs = (slots << 32) | tokens
            stops |= np.isin(pairs, self._stop_pair_array())
        stops &= out >= self.min_tokens[slots]
        reasons = np.where(stops, _STOP, _NONE)
        reasons[length] = _LENGTH
        return reasons

    def advance_decodes(self, slots: IntArray, tokens: IntArray) -> IntArray:
        """Record one kept token per slot; the slots' num_computed after it."""
        num_computed = self.num_computed[slots] + 1
        self.num_computed[slots] = num_computed
        self.num_output[slots] += 1
        self.last_token[slots] = tokens
        return num_computed

    def _stop_pair_array(self) -> IntArray:
        if self._stop_pairs is None:
            pairs = [(slot << 32) | t for slot, ids in self._stop_ids.items() for t in ids]
            self._stop_pairs = np.unique(np.array(pairs, np.int64))
        return self._stop_pairs
