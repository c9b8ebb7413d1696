"""The worker's slot state machine: apply the daemon's Tasks, run steps, report (DESIGN 4).

Positions and counters of one handle (prompt of 4 tokens, block_size 4, two blocks):

    position        0    1    2    3  |  4    5    6    7
    token           p0   p1   p2   p3 |  o0   o1   o2
    chunks          [start=0, 2 tokens]  [start=2, 2 tokens, sample] -> o0 at position 4
      after:        num_computed = 4, num_tokens = 5        (o0 has no KV yet)
    decode          feeds o0 at 4, writes KV(4), samples o1 -> num_computed 5, num_tokens 6
    + k drafts      feeds [o1, d1 .. dk] at 5 .. 5+k; accepted a: num_computed 5+a+1

After every sampling step num_computed == num_tokens - 1: the newest token's KV is written by the
next decode, so a decode needs block room for positions num_computed .. num_computed + k, i.e.
num_computed + k < len(block_ids) * block_size. `StepReport.num_computed` is that count after
the step; a handle that stopped mid-way through accepted drafts reports only the kept ones.

A Placement whose num_cached_tokens == num_prefill_tokens decodes at once from last_token_id,
which sits at position num_prefill_tokens (the prefill/decode hand-off, a full prefix hit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import (
    Chunk,
    Extension,
    FinishReason,
    KvSend,
    Placement,
    SamplingParams,
    StepReport,
    Tasks,
)
from kvsched.worker_stub.executor import Executor, SeqWork

log = logging.getLogger(__name__)

__all__ = ["ProtocolError", "WorkerEngine", "check_stop", "ngram_draft"]

DraftFn = Callable[[list[int], int], list[int]]
KvSender = Callable[[KvSend, bytes], None]


class _Ready(Enum):
    RUN = 1
    WAIT = 2  # waiting for the next chunk
    NO_ROOM = 3  # its next positions lie past its block table


@dataclass(slots=True)
class _Slot:
    """One handle held by this worker."""

    handle: int
    slot: int
    req_id: str
    block_ids: list[int]
    num_computed: int  # positions [0, num_computed) have KV
    num_prefill: int
    num_output: int  # outputs so far, earlier placements included (counts toward max_tokens)
    sampling: SamplingParams
    last_token: int | None  # the newest token, not yet in KV; None until the prompt is done
    history: list[int] = field(default_factory=list)  # tokens seen here, for draft proposers
    chunks: dict[int, list[int]] = field(default_factory=dict)  # start -> token ids
    kv_send: KvSend | None = None
    paused: bool = False


def check_stop(
    sampling: SamplingParams,
    tokens: list[int],
    num_tokens: int,
    num_output: int,
    eos_token_id: int,
    max_model_len: int,
) -> tuple[int, FinishReason]:
    """How many of the newly sampled `tokens` to keep, and why the sequence stops (NONE: it
    goes on). num_tokens / num_output count the sequence before them. As vLLM v1: length
    (max_tokens, max_model_len) first; EOS and stop tokens only once min_tokens are out; the
    stopping token is kept.
    """
    for i, token in enumerate(tokens, 1):
        out = num_output + i
        if out >= sampling.max_tokens or num_tokens + i >= max_model_len:
            return i, FinishReason.LENGTH
        is_eos = token == eos_token_id and not sampling.ignore_eos
        if out >= sampling.min_tokens and (is_eos or token in sampling.stop_token_ids):
            return i, FinishReason.STOP
    return len(tokens), FinishReason.NONE


def ngram_draft(
    history: list[int], k: int, *, min_n: int = 1, max_n: int = 3, window: int = 4096
) -> list[int]:
    """Prompt-lookup drafts: find the latest earlier occurrence of the history's last n tokens
    (longest n first, within the last `window` tokens) and propose up to k tokens that followed.
    """
    tail = history[-window:]
    if k <= 0 or len(tail) < 2:
        return []
    rev = tail[::-1]  # rev[i] is tail[-1 - i]; searching rev finds the latest match first
    for n in range(min(max_n, len(tail) - 1), min_n - 1, -1):
        pattern = rev[:n]
        i = 1
        while (i := _index(rev, pattern[0], i)) >= 0:
            if rev[i : i + n] == pattern:
                return tail[len(tail) - i : len(tail) - i + k]
            i += 1
    return []


def _index(items: list[int], value: int, start: int) -> int:
    try:
        return items.index(value, start)
    except ValueError:
        return -1


class WorkerEngine:
    """Holds the handles placed on this worker and runs one step at a time over them.

    Not thread-safe: one loop calls apply() with every Tasks received, then step().
    """

    def __init__(
        self,
        executor: Executor,
        block_size: int,
        num_slots: int,
        eos_token_id: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        draft: DraftFn | None = None,
        kv_sender: KvSender | None = None,
    ) -> None:
        """draft proposes speculative tokens; with num_speculative_tokens > 0 and no draft,
        `ngram_draft` is used. kv_sender pushes a finished prompt's KV (prefill role)."""
        for name, value in [("block_size", block_size), ("num_slots", num_slots)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_model_len < 2 or num_speculative_tokens < 0:
            raise ValueError(
                f"need max_model_len >= 2 and num_speculative_tokens >= 0, "
                f"got {max_model_len} and {num_speculative_tokens}"
            )
        self.executor = executor
        self.block_size = block_size
        self.num_slots = num_slots
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self._draft = draft if draft is not None or not num_speculative_tokens else ngram_draft
        self._kv_sender = kv_sender
        self._clear()

    def _clear(self) -> None:
        self._held: dict[int, _Slot] = {}  # handle -> state, in placement order
        self._occupant: dict[int, int] = {}  # slot -> handle
        self._acked: dict[int, None] = {}  # ordered sets of handles for the next report
        self._failed: dict[int, None] = {}
        self._sends_due: dict[int, KvSend] = {}  # handle -> where its prompt's KV goes
        self.applied_seq = 0  # highest Tasks.seq applied
        self.step_count = 0  # reports produced

    def reset(self) -> None:
        """Forget every handle and all KV (a reconnect starts from an empty cache)."""
        self._clear()
        self.executor.reset()

    def holds(self, handle: int) -> bool:
        return handle in self._held

    # ---- applying tasks -------------------------------------------------------------------

    def apply(self, tasks: Tasks) -> None:
        """Apply one Tasks message in the documented order. Tasks naming a handle this worker
        does not hold are acknowledged (next report's `acked`) and dropped; so are preempted
        and aborted handles. Raises ProtocolError on tasks that cannot be right (a handle or
        slot already taken, a chunk past the prompt)."""
        for handle in (*tasks.preempts, *tasks.aborts):
            if handle in self._held:
                self._free(handle)
            self._acked[handle] = None
        for placement in tasks.placements:
            self._place(placement)
        for extension in tasks.extensions:
            self._extend(extension)
        for chunk in tasks.chunks:
            self._queue_chunk(chunk)
        for send in tasks.kv_sends:
            self._attach_send(send)
        # reset_prefix_cache concerns the daemon's block index only: the KV stays where it is.
        self.applied_seq = max(self.applied_seq, tasks.seq)

    def _lookup(self, handle: int) -> _Slot | None:
        """The handle's state; None, and acknowledged, when this worker does not hold it."""
        s = self._held.get(handle)
        if s is None:
            self._acked[handle] = None
        return s

    def _free(self, handle: int) -> None:
        """The one path that drops a handle: finish, preempt, abort, failure, hand-off."""
        s = self._held.pop(handle)
        del self._occupant[s.slot]
        self._sends_due.pop(handle, None)

    def _place(self, p: Placement) -> None:
        if p.handle in self._held:
            raise ProtocolError(f"handle {p.handle} is already placed")
        if not 0 <= p.slot < self.num_slots:
            raise ProtocolError(f"slot {p.slot} out of range [0, {self.num_slots})")
        if p.slot in self._occupant:
            raise ProtocolError(f"slot {p.slot} still holds handle {self._occupant[p.slot]}")
        if not 0 <= p.num_cached_tokens <= p.num_prefill_tokens:
            raise ProtocolError(f"handle {p.handle}: num_cached_tokens out of range")
        decoding = p.num_cached_tokens == p.num_prefill_tokens
        if decoding and p.last_token_id < 0:
            raise ProtocolError(f"handle {p.handle}: nothing to prefill and no last_token_id")
        self._occupant[p.slot] = p.handle
        self._held[p.handle] = _Slot(
            handle=p.handle,
            slot=p.slot,
            req_id=p.req_id,
            block_ids=list(p.block_ids),
            num_computed=p.num_cached_tokens,
            num_prefill=p.num_prefill_tokens,
            num_output=p.num_output_tokens,
            sampling=p.sampling,
            last_token=p.last_token_id if decoding else None,
            history=[p.last_token_id] if decoding else [],
        )

    def _extend(self, e: Extension) -> None:
        s = self._lookup(e.handle)
        if s is not None:
            s.block_ids.extend(e.block_ids)
            s.paused = False

    def _queue_chunk(self, c: Chunk) -> None:
        s = self._lookup(c.handle)
        if s is None or s.last_token is not None or c.start < s.num_computed:
            return  # a stale chunk: those positions already have KV
        if c.start + len(c.token_ids) > s.num_prefill or not c.token_ids:
            raise ProtocolError(
                f"handle {c.handle}: chunk at {c.start} is empty or past the prompt"
            )
        s.chunks[c.start] = list(c.token_ids)

    def _attach_send(self, send: KvSend) -> None:
        s = self._lookup(send.handle)
        if s is not None:
            s.kv_send = send
            if s.last_token is not None:  # prompt already done: push before it decodes
                self._sends_due[s.handle] = send

    # ---- stepping --------------------------------------------------------------------------

    def has_runnable(self) -> bool:
        """True when step() would return a report: a slot can run, a slot newly lacks room,
        a KV push is due, or acknowledgements and failures wait to be reported."""
        if self._acked or self._failed or self._sends_due:
            return True
        for s in self._held.values():
            ready = self._readiness(s)
            if ready is _Ready.RUN or (ready is _Ready.NO_ROOM and not s.paused):
                return True
        return False

    def step(self) -> StepReport | None:
        """Run one step over all runnable handles and report it; None when nothing to do.

        Each handle contributes at most one SeqWork: its next prefill chunk (the one starting
        at num_computed), or one decode (+ drafts) once its prompt is done. Finished handles are
        dropped; a handle whose prompt completed with a KvSend is pushed, then dropped.
        """
        if not self.has_runnable():
            return None
        self.step_count += 1
        report = StepReport(step=self.step_count, applied_seq=self.applied_seq)
        self._push_kv()  # sends attached after the prompt finished, before any decode
        batch = self._build_batch(report)
        if batch:
            result = self.executor.execute([w for _, w in batch])
            for (s, w), tokens in zip(batch, result.tokens, strict=True):
                self._record(s, w, tokens, report)
            report.step_time_ns = round(result.step_time_s * 1e9)
        self._push_kv()
        report.acked = list(self._acked)
        report.failed = list(self._failed)
        self._acked.clear()
        self._failed.clear()
        return report

    def _capacity(self, s: _Slot) -> int:
        return len(s.block_ids) * self.block_size

    def _readiness(self, s: _Slot) -> _Ready:
        if s.last_token is not None:
            return _Ready.RUN if s.num_computed < self._capacity(s) else _Ready.NO_ROOM
        tokens = s.chunks.get(s.num_computed)
        if tokens is None:
            return _Ready.WAIT
        fits = s.num_computed + len(tokens) <= self._capacity(s)
        return _Ready.RUN if fits else _Ready.NO_ROOM

    def _build_batch(self, report: StepReport) -> list[tuple[_Slot, SeqWork]]:
        batch = []
        for s in self._held.values():
            ready = self._readiness(s)
            if ready is _Ready.RUN:
                batch.append((s, self._work(s)))
            elif ready is _Ready.NO_ROOM and not s.paused:
                s.paused = True
                report.paused.append(s.handle)
        return batch

    def _work(self, s: _Slot) -> SeqWork:
        start = s.num_computed
        if s.last_token is None:
            tokens = s.chunks.pop(start)
            sample = start + len(tokens) == s.num_prefill
            return SeqWork(s.handle, s.req_id, s.block_ids, start, tokens, sample, 0, s.sampling)
        drafts = self._propose(s)
        tokens = [s.last_token, *drafts]
        return SeqWork(
            s.handle, s.req_id, s.block_ids, start, tokens, True, len(drafts), s.sampling
        )

    def _propose(self, s: _Slot) -> list[int]:
        """Drafts that fit the block room, max_tokens and max_model_len even if all accepted."""
        num_tokens = s.num_computed + 1
        k = min(
            self.num_speculative_tokens,
            self._capacity(s) - s.num_computed - 1,
            s.sampling.max_tokens - s.num_output - 1,
            self.max_model_len - num_tokens - 1,
        )
        if k <= 0 or self._draft is None:
            return []
        return list(self._draft(s.history, k))[:k]

    def _record(self, s: _Slot, w: SeqWork, tokens: list[int], report: StepReport) -> None:
        """Advance a handle by what its SeqWork produced; add its report row."""
        prompt_done = s.last_token is None
        if prompt_done:
            s.history.extend(w.token_ids)
            s.num_computed = w.start + len(w.token_ids)
        if not w.sample:
            self._add_row(report, s, [], FinishReason.NONE)
            return
        if not 1 <= len(tokens) <= w.num_draft + 1:
            raise RuntimeError(
                f"{self.executor.name} returned {len(tokens)} tokens for "
                f"a step with {w.num_draft} drafts"
            )
        num_tokens = s.num_computed if prompt_done else s.num_computed + 1
        num_kept, reason = check_stop(
            s.sampling, tokens, num_tokens, s.num_output, self.eos_token_id, self.max_model_len
        )
        kept = tokens[:num_kept]
        if not prompt_done:
            s.num_computed += num_kept  # KV of the last token and the kept drafts
        s.num_output += num_kept
        s.history.extend(kept)
        s.last_token = kept[-1]
        self._add_row(report, s, kept, reason)
        if reason is not FinishReason.NONE:
            self._free(s.handle)
        elif prompt_done and s.kv_send is not None:
            self._sends_due[s.handle] = s.kv_send

    @staticmethod
    def _add_row(report: StepReport, s: _Slot, kept: list[int], reason: FinishReason) -> None:
        report.handles.append(s.handle)
        report.num_computed.append(s.num_computed)
        report.num_new_tokens.append(len(kept))
        report.token_ids.extend(kept)
        report.finish_reasons.append(int(reason))

    def _push_kv(self) -> None:
        """Push each due handle's prompt KV through kv_sender, then drop the handle (the
        prefill role is done with it); a failed push puts it in `failed`."""
        for handle, send in list(self._sends_due.items()):
            s = self._held[handle]
            num_blocks = -(-s.num_computed // self.block_size)
            try:
                if self._kv_sender is None:
                    raise RuntimeError("no kv_sender configured")
                if len(send.dst_block_ids) < num_blocks:
                    raise ValueError(f"{num_blocks} blocks to send, destination has fewer")
                data = self.executor.export_kv(s.block_ids[:num_blocks])
                self._kv_sender(send, data)
            except Exception:
                log.warning("KV push of handle %d failed", handle, exc_info=True)
                self._failed[handle] = None
            self._free(handle)
