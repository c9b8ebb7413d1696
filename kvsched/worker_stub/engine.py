"""The worker's slot state machine: apply the daemon's Tasks, run steps, report (the rules are
in the WorkerService comment of protos/kvsched/v1/worker_service.proto). The engine owns the
handles it holds; one handle's SeqWork and the counters its tokens advance are `rows.Rows`'
(the positions and counters are drawn there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

import numpy as np

from kvsched.core.errors import ProtocolError
from kvsched.core.logprobs import TokenLogprobs
from kvsched.core.protocol import (
    Chunk,
    Extension,
    KvSend,
    Placement,
    StepReport,
    Tasks,
)
from kvsched.worker_stub.encoder_drops import check_encoder_drops
from kvsched.worker_stub.executor import ColumnarExecutor, Executor, SeqWork, StepResult
from kvsched.worker_stub.host_kv import HostCopies
from kvsched.worker_stub.rows import After, Held, Rows
from kvsched.worker_stub.slots import IntArray, SlotTable
from kvsched.worker_stub.storage_kv import StorageTasks
from kvsched.worker_stub.tokens import DraftFn, check_stop, ngram_draft

log = logging.getLogger(__name__)

__all__ = ["ProtocolError", "WorkerEngine", "check_stop", "ngram_draft"]

KvSender = Callable[[KvSend, bytes], None]


class _Ready(Enum):
    RUN = 1
    NO_ROOM = 2  # its next positions lie past its block table


class WorkerEngine:
    """Holds the handles placed on this worker and runs one step at a time over them.

    Not thread-safe: one loop calls apply() with every Tasks received, then step().

    A step costs Python work per handle that a task touched or whose state changes (a chunk,
    a prompt that completes, a finish, a pause), plus per decoding handle either one SeqWork
    through `Executor.execute` or, with `columnar`, a share of a few numpy operations.
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
        columnar: bool = False,
    ) -> None:
        """draft proposes speculative tokens; with num_speculative_tokens > 0 and no draft,
        `ngram_draft` is used. kv_sender pushes a finished prompt's KV (prefill role).

        columnar: decode as numpy columns through the executor's `execute_columns` (the sim's;
        ValueError when it has none) instead of one SeqWork per handle: same tokens and
        reports, rows in another order. Speculative steps always take the SeqWork path."""
        for name, value in [("block_size", block_size), ("num_slots", num_slots)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_model_len < 2 or num_speculative_tokens < 0:
            raise ValueError(
                f"need max_model_len >= 2 and num_speculative_tokens >= 0, "
                f"got {max_model_len} and {num_speculative_tokens}"
            )
        if columnar and not isinstance(executor, ColumnarExecutor):
            raise ValueError(f"executor {executor.name!r} has no columnar decode path")
        self.executor = executor
        self.block_size = block_size
        self.num_slots = num_slots
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self._draft = draft if draft is not None or not num_speculative_tokens else ngram_draft
        self._kv_sender = kv_sender
        self._columnar = columnar and not num_speculative_tokens
        self._clear()

    def _clear(self) -> None:
        self._held: dict[int, Held] = {}  # handle -> state, in placement order
        self._occupant: dict[int, int] = {}  # slot -> handle
        self._table = SlotTable(self.num_slots)
        self._rows = Rows(
            self._table,
            self.executor.name,
            self.eos_token_id,
            self.max_model_len,
            self.num_speculative_tokens,
            self._draft,
        )
        self._prefills: dict[int, None] = {}  # prompt not done, chunk at num_computed queued
        self._acked: dict[int, None] = {}  # ordered sets of handles for the next report
        self._failed: dict[int, None] = {}
        self._copies = HostCopies(self.executor)  # the host KV tier's copies (host_kv.py)
        self.storage = StorageTasks(self.executor)  # the storage tier's tasks (storage_kv.py)
        self._stalled: set[int] = set()  # handles whose swap-in or fetch failed: await a preempt
        self._sends_due: dict[int, KvSend] = {}  # handle -> where its prompt's KV goes
        self.applied_seq = 0  # highest Tasks.seq applied
        self.step_count = 0  # reports produced
        self.num_draft_tokens = 0  # speculative drafts verified, and of them accepted
        self.num_accepted_drafts = 0
        self.kv_export_s = 0.0  # reading pushed KV out of the executor's cache (prefill role)
        self.num_prefill_tokens = 0  # prompt positions computed by chunks (a prefix hit: none)
        # Rows run by a step launched ahead, deferred into one, and run ahead for nothing
        # (the vLLM executor's: worker_vllm/ahead.py).
        self.num_rows_ahead = self.num_rows_deferred = self.num_rows_wasted = 0
        self._num_lora_held = 0  # held handles naming a LoRA adapter
        self.step_loras = 0  # distinct LoRA adapters the last step ran

    def reset(self) -> None:
        """Forget every handle and all KV (a reconnect starts from an empty cache)."""
        self._clear()
        self.executor.reset()

    def holds(self, handle: int) -> bool:
        return handle in self._held

    @property
    def num_held(self) -> int:
        """Handles placed here and not yet dropped."""
        return len(self._held)

    def num_computed(self, handle: int) -> int:
        """Positions of a held handle that have KV (KeyError when not held)."""
        return int(self._table.num_computed[self._held[handle].slot])

    # ---- applying tasks -------------------------------------------------------------------

    def apply(self, tasks: Tasks) -> None:
        """Apply one Tasks message in the documented order. Tasks naming a handle this worker
        does not hold are acknowledged (next report's `acked`) and dropped; so are preempted
        and aborted handles. Raises ProtocolError on tasks that cannot be right (a handle or
        slot already taken, a chunk past the prompt)."""
        if tasks.reset_prefix_cache:
            # The daemon forgot the host tier before it queued this message's copies: forget
            # its contents first (the swap-outs below are the first it will name again).
            self._copies.drop()
        if tasks.swap_out_gpu:  # before anything in this message may overwrite those blocks
            self._copies.swap_out(tasks.swap_out_gpu, tasks.swap_out_host)
        self.storage.write_all(tasks)  # storage_writes: right after swap_outs (step 13)
        self.storage.prefetch_all(tasks)  # storage -> host, for requests still queued
        for handle in (*tasks.preempts, *tasks.aborts):
            if handle in self._held:
                self._free(handle)
            self._acked[handle] = None
        if tasks.encoder_drops:
            self._drop_encoder_items(tasks.encoder_drops)
        for placement in tasks.placements:
            self._place(placement)
        for extension in tasks.extensions:
            self._extend(extension)
        t, ahead = tasks, None
        if (t.swap_in_gpu or t.storage_fetch_keys) and hasattr(self.executor, "copies_ahead"):
            # A copy stream: the copies of handles with no chunk here run beside the step.
            ahead = {*t.swap_in_handles, *t.storage_fetch_handles}
            ahead.difference_update(c.handle for c in t.chunks)
        if tasks.swap_in_gpu:  # before any chunk that reads them
            copies = self._copies.swap_in(t.swap_in_handles, t.swap_in_host, t.swap_in_gpu, ahead)
            self._stall(copies)
        self._stall(self.storage.fetch_all(tasks, ahead))  # storage_fetches: after swap_ins
        for chunk in tasks.chunks:
            self._queue_chunk(chunk)
        for send in tasks.kv_sends:
            self._attach_send(send)
        if tasks.reset_prefix_cache and (clear := getattr(self.executor, "clear_encoder", None)):
            clear()  # queued chunks that read an item encode it again
        self.applied_seq = max(self.applied_seq, tasks.seq)

    def _drop_encoder_items(self, hashes: list[str]) -> None:
        held = [(s.handle, s.mm_ranges, s.chunks) for s in self._held.values() if s.mm_ranges]
        check_encoder_drops(held, hashes)  # ProtocolError: a queued chunk still reads one
        if (drop := getattr(self.executor, "drop_encoder_items", None)) is not None:
            drop(hashes)

    def _stall(self, handles: list[int]) -> None:
        """A handle whose swap-in or storage fetch failed does not run: its chunks are dropped
        (and later ones ignored) until the daemon's preempt arrives."""
        for handle in handles:
            if handle in self._held:
                self._stalled.add(handle)
                self._prefills.pop(handle, None)
                self._held[handle].chunks.clear()

    def slots_free_for(self, tasks: Tasks) -> bool:
        """Whether every placement in `tasks` finds its slot free once its own preempts and
        aborts are applied."""
        if not tasks.placements:
            return True
        dropped = {*tasks.preempts, *tasks.aborts}
        occupant = self._occupant
        return all(
            occupant.get(p.slot) is None or occupant[p.slot] in dropped for p in tasks.placements
        )

    def _lookup(self, handle: int) -> Held | None:
        """The handle's state; None, and acknowledged, when this worker does not hold it."""
        s = self._held.get(handle)
        if s is None:
            self._acked[handle] = None
        return s

    def _free(self, handle: int) -> None:
        """The one path that drops a handle: finish, preempt, abort, failure, hand-off."""
        s = self._held.pop(handle)
        if s.lora_name:
            self._num_lora_held -= 1
        del self._occupant[s.slot]
        self._table.vacate(s.slot)
        self._prefills.pop(handle, None)
        self._sends_due.pop(handle, None)
        self._stalled.discard(handle)

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
        self._held[p.handle] = Held(
            handle=p.handle,
            slot=p.slot,
            req_id=p.req_id,
            block_ids=list(p.block_ids),
            num_prefill=p.num_prefill_tokens,
            sampling=p.sampling,
            history=[p.last_token_id] if decoding and self._draft is not None else [],
            mm_ranges=p.mm_ranges,
            lora_name=p.lora_name,
        )
        if p.lora_name:
            self._num_lora_held += 1
        t = self._table
        key = self.executor.request_key(p.req_id) if self._columnar else 0  # type: ignore[attr-defined]
        t.occupy(p.slot, p.handle, p.sampling, key)
        t.num_computed[p.slot] = p.num_cached_tokens
        t.num_output[p.slot] = p.num_output_tokens
        t.capacity[p.slot] = len(p.block_ids) * self.block_size
        if decoding:
            t.decoding[p.slot] = True
            t.last_token[p.slot] = p.last_token_id

    def _extend(self, e: Extension) -> None:
        s = self._lookup(e.handle)
        if s is not None:
            s.block_ids.extend(e.block_ids)
            self._table.capacity[s.slot] = len(s.block_ids) * self.block_size
            self._table.paused[s.slot] = False

    def _queue_chunk(self, c: Chunk) -> None:
        if self._copies.ahead:
            self._copies.ahead_read(c.handle)
        if self.storage.fetched_ahead:
            self.storage.ahead_read(c.handle)
        s = self._lookup(c.handle)
        if s is None or self._table.decoding[s.slot] or c.handle in self._stalled:
            return  # the prompt is done (a stale chunk), or its swap-in failed
        num_computed = int(self._table.num_computed[s.slot])
        if c.start < num_computed:
            return  # a stale chunk: those positions already have KV
        if c.start + len(c.token_ids) > s.num_prefill or not c.token_ids:
            raise ProtocolError(
                f"handle {c.handle}: chunk at {c.start} is empty or past the prompt"
            )
        s.chunks[c.start] = list(c.token_ids)
        if c.start == num_computed:
            self._prefills[s.handle] = None

    def _attach_send(self, send: KvSend) -> None:
        s = self._lookup(send.handle)
        if s is not None:
            s.kv_send = send
            if self._table.decoding[s.slot]:  # prompt already done: push before it decodes
                self._sends_due[s.handle] = send

    # ---- stepping --------------------------------------------------------------------------

    def has_runnable(self) -> bool:
        """True when step() would return a report: a slot can run, a slot newly lacks room,
        a KV push is due, or acknowledgements and failures wait to be reported."""
        if self._acked or self._failed or self._sends_due or self._copies.pending:
            return True  # (copies: the report's applied_seq acknowledges them)
        if self.storage.pending:  # (so do storage tasks)
            return True
        for handle in self._prefills:
            s = self._held[handle]
            if self._chunk_readiness(s) is _Ready.RUN or not self._table.paused[s.slot]:
                return True
        return self._table.any_decode_news()

    def step(self) -> StepReport | None:
        """Run one step over all runnable handles and report it; None when nothing to do.

        Each handle contributes at most one SeqWork: its next prefill chunk (the one starting
        at num_computed), or one decode (+ drafts) once its prompt is done. Finished handles are
        dropped; a handle whose prompt completed with a KvSend is pushed, then dropped. Rows:
        prefill chunks first, then decodes in slot order (not placement order: rows of
        different handles are independent).
        """
        if not self.has_runnable():
            return None
        self._copies.ahead.clear()  # swapped in / fetched beside this step
        self.storage.fetched_ahead.clear()
        self.step_count += 1
        report = StepReport(step=self.step_count, applied_seq=self.applied_seq)
        self._push_kv()  # sends attached after the prompt finished, before any decode
        prefills = self._take_prefills(report)
        t = self._table
        report.paused.extend(t.handle[t.take_newly_blocked()].tolist())
        decodes = np.flatnonzero(t.decode_runnable())
        self.step_loras = self._count_loras(prefills, decodes) if self._num_lora_held else 0
        if self._columnar:
            self._run_columns(prefills, decodes, report)
        elif prefills or len(decodes):
            held, occupant = self._held, self._occupant
            batch = prefills + [
                (s, self._rows.work(s)) for s in (held[occupant[i]] for i in decodes.tolist())
            ]
            result = self.executor.execute([w for _, w in batch])
            lps = result.logprobs is not None or result.prompt_logprobs is not None
            deferred = set(result.deferred or ())
            self.num_rows_ahead += result.num_ahead
            self.num_rows_deferred += len(deferred)
            self.num_rows_wasted += result.num_wasted
            for j, ((s, w), tokens) in enumerate(zip(batch, result.tokens, strict=True)):
                if j in deferred:
                    self._defer(s, w)
                    continue
                self._record(s, w, tokens, report)
                if lps:  # (rows of works that asked: the vLLM executor's)
                    add_logprobs(report, s.handle, result, j)
            if report.num_logprobs:
                report.num_logprobs.extend([0] * (len(report.handles) - len(report.num_logprobs)))
            report.step_time_ns = round(result.step_time_s * 1e9)
        self._push_kv()
        report.acked = list(self._acked)
        report.failed = list(self._failed)
        self._acked.clear()
        self._failed.clear()
        self._copies.fill(report)
        self.storage.fill(report)
        return report

    def _count_loras(self, prefills: list[tuple[Held, SeqWork]], decodes: IntArray) -> int:
        """Distinct LoRA adapters among the handles this step runs (vLLM's per-step count)."""
        held, occupant = self._held, self._occupant
        names = {s.lora_name for s, _ in prefills}
        names.update(held[occupant[i]].lora_name for i in decodes.tolist())
        names.discard("")
        return len(names)

    def _chunk_readiness(self, s: Held) -> _Ready:
        """Of a handle in _prefills: whether its queued chunk fits its blocks."""
        num_computed = int(self._table.num_computed[s.slot])
        fits = num_computed + len(s.chunks[num_computed]) <= self._table.capacity[s.slot]
        return _Ready.RUN if fits else _Ready.NO_ROOM

    def _take_prefills(self, report: StepReport) -> list[tuple[Held, SeqWork]]:
        """The SeqWork of every queued chunk that fits; the others are reported paused once."""
        batch = []
        for handle in list(self._prefills):
            s = self._held[handle]
            if self._chunk_readiness(s) is _Ready.RUN:
                del self._prefills[handle]
                work = self._rows.work(s)
                self.num_prefill_tokens += len(work.token_ids)
                batch.append((s, work))
            elif not self._table.paused[s.slot]:
                self._table.paused[s.slot] = True
                report.paused.append(handle)
        return batch

    def _run_columns(
        self, prefills: list[tuple[Held, SeqWork]], decodes: IntArray, report: StepReport
    ) -> None:
        """Run prefills as SeqWorks and the decodes as columns, in one executor step."""
        if not prefills and not len(decodes):
            return
        t = self._table
        executor: ColumnarExecutor = self.executor  # type: ignore[assignment]
        positions = t.num_computed[decodes] + 1  # each decode samples the position after its KV
        result, tokens = executor.execute_columns(
            [w for _, w in prefills], t.key[decodes], positions
        )
        for (s, w), sampled in zip(prefills, result.tokens, strict=True):
            self._record(s, w, sampled, report)
        if len(decodes):
            for slot in self._rows.record_columns(decodes, tokens, report).tolist():
                self._free(self._occupant[slot])
        report.step_time_ns = round(result.step_time_s * 1e9)

    def _defer(self, s: Held, w: SeqWork) -> None:
        """A SeqWork the executor did not run this step: nothing advances; a chunk goes back to
        the queue, to be offered first in the next step."""
        if not self._table.decoding[s.slot]:
            s.chunks[w.start] = w.token_ids
            self._prefills[s.handle] = None
            self.num_prefill_tokens -= len(w.token_ids)

    def _record(self, s: Held, w: SeqWork, tokens: list[int], report: StepReport) -> None:
        """Advance a handle by what its SeqWork produced (its report row), then act on it."""
        if w.num_draft:
            accepted = min(w.num_draft, max(0, len(tokens) - 1))
            self.num_draft_tokens += w.num_draft
            self.num_accepted_drafts += accepted
            report.draft_handles.append(s.handle)
            report.num_draft_tokens.append(w.num_draft)
            report.num_accepted_drafts.append(accepted)
        after = self._rows.record(s, w, tokens, report)
        if after is After.NEXT_CHUNK:
            self._prefills[s.handle] = None
        elif after is After.FINISHED:
            self._free(s.handle)
        elif after is After.SEND_KV and s.kv_send is not None:
            self._sends_due[s.handle] = s.kv_send

    def _push_kv(self) -> None:
        """Push each due handle's prompt KV through kv_sender, then drop the handle (the
        prefill role is done with it); a failed push puts it in `failed`."""
        for handle, send in list(self._sends_due.items()):
            s = self._held[handle]
            num_blocks = -(-self.num_computed(handle) // self.block_size)
            try:
                if self._kv_sender is None:
                    raise RuntimeError("no kv_sender configured")
                if len(send.dst_block_ids) < num_blocks:
                    raise ValueError(f"{num_blocks} blocks to send, destination has fewer")
                started = time.perf_counter()
                data = self.executor.export_kv(s.block_ids[:num_blocks])
                self.kv_export_s += time.perf_counter() - started
                self._kv_sender(send, data)
            except Exception:
                log.warning("KV push of handle %d failed", handle, exc_info=True)
                self._failed[handle] = None
            self._free(handle)


def add_logprobs(report: StepReport, handle: int, result: StepResult, j: int) -> None:
    """SeqWork j's log-probability rows into the report, after its row (the last one): one
    per token kept (a stop cuts the rest), and its prompt's rows once its last chunk ran."""
    rows = result.logprobs[j] if result.logprobs is not None else []
    kept = int(report.num_new_tokens[-1]) if len(report.handles) else 0
    if rows and kept and report.handles[-1] == handle:
        counts = report.num_logprobs
        counts.extend([0] * (len(report.handles) - 1 - len(counts)))
        counts.append(kept)
        if report.logprobs is None:
            report.logprobs = TokenLogprobs()
        report.logprobs.extend(rows[:kept])
    prompt = result.prompt_logprobs[j] if result.prompt_logprobs is not None else None
    if prompt is not None:
        report.prompt_logprob_handles.append(handle)
        report.num_prompt_logprobs.append(len(prompt))
        if report.prompt_logprobs is None:
            report.prompt_logprobs = TokenLogprobs()
        report.prompt_logprobs.extend(prompt)
