"""One held handle's part of a worker step: the SeqWork it runs and what the executor's tokens
do to its counters and its report row (the engine decides what happens to the handle after).

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

from dataclasses import dataclass, field
from enum import Enum

from kvsched.core.protocol import (
    FinishReason,
    KvSend,
    MultimodalRange,
    SamplingParams,
    StepReport,
)
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_stub.slots import IntArray, SlotTable
from kvsched.worker_stub.tokens import DraftFn, check_stop

_NONE = int(FinishReason.NONE)


@dataclass(slots=True)
class Held:
    """One handle held by this worker. Its counters live in the engine's SlotTable (columns
    indexed by slot): num_computed, num_output, last_token, capacity, paused."""

    handle: int
    slot: int
    req_id: str
    block_ids: list[int]
    num_prefill: int
    sampling: SamplingParams
    history: list[int] = field(default_factory=list)  # tokens seen here, for draft proposers
    chunks: dict[int, list[int]] = field(default_factory=dict)  # start -> token ids
    kv_send: KvSend | None = None
    mm_ranges: list[MultimodalRange] = field(default_factory=list)
    lora_name: str = ""  # its LoRA adapter (Placement.lora_name; "" = the base model)


class After(Enum):
    """What a recorded row asks of the engine for its handle."""

    NOTHING = 0
    NEXT_CHUNK = 1  # its prompt continues and the chunk at num_computed is already queued
    FINISHED = 2  # drop it
    SEND_KV = 3  # its prompt is done and a KvSend is attached: push its KV


class Rows:
    """The per-handle arithmetic of a step over one SlotTable: builds each handle's SeqWork
    (chunk or decode + drafts) and advances its counters by the tokens it produced, adding its
    report row. Holds no handles; the engine owns them and acts on the returned `After`."""

    def __init__(
        self,
        table: SlotTable,
        executor_name: str,
        eos_token_id: int,
        max_model_len: int,
        num_speculative_tokens: int,
        draft: DraftFn | None,
    ) -> None:
        self._table = table
        self._executor_name = executor_name
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self._draft = draft

    def work(self, s: Held) -> SeqWork:
        """The handle's SeqWork: its chunk at num_computed (popped), or one decode + drafts."""
        t, i = self._table, s.slot
        start = int(t.num_computed[i])
        if not t.decoding[i]:
            tokens = s.chunks.pop(start)
            sample = start + len(tokens) == s.num_prefill
            return SeqWork(
                s.handle, s.req_id, s.block_ids, start, tokens, sample, 0, s.sampling, s.mm_ranges
            )
        drafts = self._propose(s, start)
        tokens = [int(t.last_token[i]), *drafts]
        return SeqWork(
            s.handle, s.req_id, s.block_ids, start, tokens, True, len(drafts), s.sampling
        )

    def _propose(self, s: Held, num_computed: int) -> list[int]:
        """Drafts that fit the block room, max_tokens and max_model_len even if all accepted."""
        if self._draft is None:
            return []
        t = self._table
        num_tokens = num_computed + 1
        k = min(
            self.num_speculative_tokens,
            int(t.capacity[s.slot]) - num_computed - 1,
            s.sampling.max_tokens - int(t.num_output[s.slot]) - 1,
            self.max_model_len - num_tokens - 1,
        )
        if k <= 0:
            return []
        return list(self._draft(s.history, k))[:k]

    def record(self, s: Held, w: SeqWork, tokens: list[int], report: StepReport) -> After:
        """Advance a handle by what its SeqWork produced; add its report row."""
        t, i = self._table, s.slot
        prompt_done = not t.decoding[i]
        if prompt_done:
            if self._draft is not None:
                s.history.extend(w.token_ids)
            t.num_computed[i] = num_computed = w.start + len(w.token_ids)
        else:
            num_computed = int(t.num_computed[i])
        if not w.sample:
            add_row(report, s.handle, num_computed, [], FinishReason.NONE)
            return After.NEXT_CHUNK if num_computed in s.chunks else After.NOTHING
        if not 1 <= len(tokens) <= w.num_draft + 1:
            raise RuntimeError(
                f"{self._executor_name} returned {len(tokens)} tokens for "
                f"a step with {w.num_draft} drafts"
            )
        num_tokens = num_computed if prompt_done else num_computed + 1
        num_output = int(t.num_output[i])
        num_kept, reason = check_stop(
            s.sampling, tokens, num_tokens, num_output, self.eos_token_id, self.max_model_len
        )
        kept = tokens[:num_kept]
        if not prompt_done:
            num_computed += num_kept  # KV of the last token and the kept drafts
            t.num_computed[i] = num_computed
        t.num_output[i] = num_output + num_kept
        if self._draft is not None:
            s.history.extend(kept)
        t.last_token[i] = kept[-1]
        t.decoding[i] = True
        add_row(report, s.handle, num_computed, kept, reason)
        if reason is not FinishReason.NONE:
            return After.FINISHED
        if prompt_done and s.kv_send is not None:
            return After.SEND_KV
        return After.NOTHING

    def record_columns(self, decodes: IntArray, tokens: IntArray, report: StepReport) -> IntArray:
        """Advance the decoding slots `decodes` by one sampled token each (the columnar path);
        add their rows. Returns the slots that finished."""
        t = self._table
        reasons = t.stop_reasons(decodes, tokens, self.eos_token_id, self.max_model_len)
        report.handles.extend(t.handle[decodes].tolist())
        report.num_computed.extend(t.advance_decodes(decodes, tokens).tolist())
        report.num_new_tokens.extend([1] * len(decodes))
        report.token_ids.extend(tokens.tolist())
        report.finish_reasons.extend(reasons.tolist())
        finished: IntArray = decodes[reasons != _NONE]
        return finished


def add_row(
    report: StepReport, handle: int, num_computed: int, kept: list[int], reason: FinishReason
) -> None:
    report.handles.append(handle)
    report.num_computed.append(num_computed)
    report.num_new_tokens.append(len(kept))
    report.token_ids.extend(kept)
    report.finish_reasons.append(int(reason))
