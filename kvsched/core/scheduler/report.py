"""The report path: a worker's StepReport folded into the scheduler (`apply_report`).

Validation first, before anything changes (`report_check.ReportChecker`); then the rows:
plain decode rows (one token, handle still on its slot) as a few vectorized operations over the
slot table (`_apply_round`), every other row one by one (`_apply_rows`); then a visit to each
request that needs the scheduler (`_after_report`: caching, finish, hand-off, block extension).
These loops are tuned (see docs/BENCHMARKS.md, `python -m bench.core_step --breakdown`): keep
their locals bound and add no attribute hop per row; `ReportApplier` binds its collaborators
at construction.

The applier owns the last report's step and applied seq. It writes the reported tokens into the
slot table's rings (the table binds and unbinds rows; the tokens are the report's); every
other change goes through an owner: `Exits` (finish, preempt, hand-off, requeue), the placement
table (room, blocks needed), the outbox (extensions, the round trip), `StepPlan` (what the step
ran and cost), `Backlog` (the tenants' output). Imported by the scheduler facade only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import kvsched.core.lifecycle as lifecycle
from kvsched.core.config import EngineConfig, PdTransfer, Role
from kvsched.core.errors import ProtocolError
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import Extension, FinishReason, StepReport
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import DecodeColumn, Events, RowTokens, SchedulerStats
from kvsched.core.scheduler.exits import Exits
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.pd_storage import StorageHandOffs
from kvsched.core.scheduler.report_check import Columns, ReportChecker
from kvsched.core.scheduler.step_plan import StepPlan
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.slots import RING, RING_SHIFT, current, extend_output, set_reported

# A handle a worker names in StepReport.failed, outside a prefill's KV push.
_WORKER_FAILED = (
    "worker failed the request (a KV transfer, or a structured-output grammar its backend "
    "could not compile or that rejected a sampled token)"
)


class ReportApplier:
    """apply_report and its parts (owns the last report's step and applied seq)."""

    def __init__(
        self,
        config: EngineConfig,
        table: PlacementTable,
        kv: KVCacheManager,
        plan: StepPlan,
        backlog: Backlog,
        exits: Exits,
        outbox: Outbox,
        events: Events,
        stats: SchedulerStats,
        clock: Callable[[], float],
    ) -> None:
        self._table, self._kv, self._plan, self._backlog = table, kv, plan, backlog
        self._exits, self._outbox, self._events, self._stats = exits, outbox, events, stats
        self._clock = clock
        # Bound once: the hot path's references (none of these objects is ever replaced).
        self._slots = table.slots
        self._live = table.live
        self._block_size = table.block_size
        self._spec_k = config.speculative.num_speculative_tokens
        self._prefill_role = config.role == Role.PREFILL
        self._learn_step = plan.learn_step
        self._last_step = -1  # the last report's step
        self._last_applied_seq = -1  # the last Tasks seq a report said the worker applied
        self._checker = ReportChecker(table)
        self._push_failed: set[int] = set()  # handles of this report whose KV push failed
        # Prefill role handing off through the storage tier (pd_storage.py); None: by push.
        self.stored_hand_offs: StorageHandOffs | None = None
        if self._prefill_role and config.cache.pd_transfer == PdTransfer.STORAGE:
            self.stored_hand_offs = StorageHandOffs(table, kv, backlog, outbox, events)

    @property
    def last_report_step(self) -> int:
        return self._last_step

    def apply(self, report: StepReport) -> None:
        """Fold a worker's step report in: append tokens, register written blocks in the prefix
        cache, finish what the worker stopped, re-queue acknowledged preemptions. Raises
        ProtocolError (state unchanged) for reports that break the protocol."""
        cols = self._checker.check(
            report, self._last_step, self._last_applied_seq, self._outbox.seq
        )
        swaps = 0
        live, events, exits = self._live, self._events, self._exits
        if self._kv.host is not None and report.applied_seq > self._last_applied_seq:
            # The copies of every message up to applied_seq are done (or named as failed).
            swaps = self._kv.acknowledge_copies(
                report.applied_seq, report.failed_swap_outs, report.failed_swap_ins
            )
            for h in report.failed_swap_ins:  # its swapped-in KV is not there: recompute
                req = live.get(int(h))
                if req is not None and req.status == RequestStatus.RUNNING:
                    exits.preempt(req)
            cols.match, cols.all_match = None, False  # slots may have been freed
        fetches = 0
        if self._kv.storage is not None and report.applied_seq > self._last_applied_seq:
            # The storage tasks of every message up to applied_seq are done (or failed).
            fetches = self._kv.acknowledge_storage(
                report.applied_seq, report.failed_storage_writes, report.failed_storage_fetches
            )
            if self._kv.prefetch is not None:  # prefetched host blocks: registered now
                self._kv.acknowledge_prefetches(
                    report.applied_seq, report.failed_storage_prefetches
                )
            for h in report.failed_storage_fetches:  # its fetched KV is not there: recompute
                req = live.get(int(h))
                if req is not None and req.status == RequestStatus.RUNNING:
                    exits.preempt(req)
            if self.stored_hand_offs is not None:  # hand-offs whose writes are all done
                self.stored_hand_offs.poll()
            cols.match, cols.all_match = None, False  # slots may have been freed
        # The step's terms and measured time into the cost model, and the chunks it ran off
        # the outstanding ones (step_plan), before any row changes the slots.
        single = report.step == self._last_step + 1 or self._last_step < 0
        self._learn_step(report, cols.h, cols.s, single, swaps, fetches)
        outbox = self._outbox
        if report.applied_seq > self._last_applied_seq and outbox.sent:
            outbox.observe_lag(report)
        self._last_step, self._last_applied_seq = report.step, report.applied_seq
        get = live.get
        if report.draft_handles:  # speculative decoding: per-request draft and accepted counts
            _count_drafts(report, get, self._stats)
        # Failures first: a prefill worker reports the prompt's first token in the same report
        # as its failed KV push, and that row hands the request off as failed (the decode
        # instance recomputes it); a failure without a first-token row ends it (below).
        push_failed = self._push_failed
        if len(report.failed):
            for h in list(report.failed):
                req = live.get(int(h))
                if req is None:
                    continue
                if self._prefill_role and not req.output_token_ids:
                    push_failed.add(req.handle)
                else:
                    exits.finish(req, FinishReason.ERROR, _WORKER_FAILED)
            cols.match, cols.all_match = None, False  # slots were freed: compare again
        # The hot path: plain decode rows (one token, handle still on its slot) are a handful
        # of vectorized operations over the slot table; each row's request is looked at only
        # when its output count reaches its precomputed check (a first token, blocks to extend,
        # max_tokens). Every other row (a prefill chunk, several tokens, a late row about a
        # request no longer on its slot) is taken one by one.
        if report.num_logprobs or report.prompt_logprob_handles:  # only requests that asked
            put_logprobs(report, get)
        n_gen = len(cols.toks)
        slow: list[Request] = []
        if len(cols.h):
            # A merged report (the worker stepped faster than the stream drained) names a
            # handle once per step: apply it in rounds, each handle at most once per round.
            rounds = self._slots.rounds(cols.s, cols.h)
            last = rounds[-1]
            for idx in rounds:
                n_gen -= self._apply_round(report, cols, idx, slow, idx is last)
        fins = cols.fins
        if fins is not None:
            handles = report.handles
            for i in np.flatnonzero(fins).tolist():
                if (req := get(int(handles[i]))) is not None:
                    self._after_report(req, int(fins[i]))
        for req in dict.fromkeys(slow):  # a request once, however many rows named it
            if not req.is_finished and live.get(req.handle) is req:
                self._after_report(req, 0)
        self._stats.count_generated(n_gen)
        if push_failed:
            for h in push_failed:  # no first-token row came with its failed push
                if (req := live.get(h)) is not None:
                    exits.finish(req, FinishReason.ERROR, "worker failed the request (KV transfer)")
            push_failed.clear()
        for h in list(report.paused):
            req = live.get(int(h))
            if req is not None and req.status == RequestStatus.RUNNING and req.is_prefill_done:
                events.out_of_blocks.append(req)
                # Its table already reaches past what the worker wrote: an extension is on its
                # way (queued or in flight) and resumes the slot; another would be waste.
                if len(req.block_ids) * self._block_size <= req.num_reported_tokens:
                    self._table.need_blocks(req)
        for h in list(report.acked):
            req = live.get(int(h))
            if req is not None and req.status == RequestStatus.PREEMPTED:
                exits.requeue(req)

    def _apply_round(
        self,
        report: StepReport,
        cols: Columns,
        idx: np.ndarray | None,
        slow: list[Request],
        last: bool = True,
    ) -> int:
        """Apply report rows `idx` (None: all), no handle twice. Plain decode rows whose handle
        is still on its slot are vectorized; the rest go one by one. `last`: no round of this
        report follows. Returns the reported tokens not kept."""
        slots = self._slots
        s, rt, match, one = cols.s, cols.row_tok, cols.match, cols.one
        assert rt is not None
        py_rows: list[int] = []
        if cols.all_match and one is None:  # every row a plain decode row
            vs, vt = (s, rt) if idx is None else (s[idx], rt[idx])
        else:
            if match is None:
                match = slots.handle[s] == cols.h
            if idx is not None:
                s, rt, match = s[idx], rt[idx], match[idx]
                if one is not None:
                    one = one[idx]
            vec = match if one is None else match & one
            k = np.flatnonzero(vec)
            vs, vt = s[k], rt[k]
            rest = np.flatnonzero(~vec)
            py_rows = (rest if idx is None else idx[rest]).tolist()
        if len(vs):
            pos = slots.n_out[vs]
            slots.ring_flat[(vs << RING_SHIFT) | (pos & (RING - 1))] = vt  # ring[vs, pos % RING]
            pos += 1
            slots.n_out[vs] = pos
            slots.written()
            reqs = slots.snapshot()
            events = self._events
            events.tokens.append(DecodeColumn(reqs, vs, vt))
            due = np.flatnonzero(pos >= slots.check[vs])
            if len(due):
                due_slots = vs[due]
                first = events.first_token
                now = -1.0
                for i in due_slots.tolist():
                    req = reqs[i]
                    assert req is not None
                    if not last:
                        slots.sync(req)  # its ring is free again for the later rounds
                    slow.append(req)
                    if req.first_token_time < 0:
                        if now < 0:
                            now = self._clock()
                        lifecycle.first_token(req, now)
                        first.append(req)
                if not last:
                    # Later rounds of a merged report find it due again only if its ring
                    # fills; the visit after the last round sets its real next check.
                    slots.check[due_slots] = pos[due] + RING
        return self._apply_rows(report, py_rows, slow) if py_rows else 0

    def _apply_rows(self, report: StepReport, rows: list[int], slow: list[Request]) -> int:
        """Report rows taken one by one, in order. Returns the reported tokens not kept (rows
        about requests gone, tokens past max_tokens)."""
        events = self._events
        get, first, deltas = self._live.get, events.first_token, events.tokens
        toks, nums, comps, handles = (
            report.token_ids,
            report.num_new_tokens,
            report.num_computed,
            report.handles,
        )
        ends = np.cumsum(np.asarray(nums, dtype=np.int64)).tolist()
        dropped = 0
        for i in rows:
            n_new = int(nums[i])
            req = get(int(handles[i]))
            if req is None:  # late report about a finished/aborted occupant
                dropped += n_new
                continue
            set_reported(req, int(comps[i]))  # (moves its ring tokens to it first)
            n_out = len(current(req)[0])
            if n_new:
                if not n_out:
                    lifecycle.first_token(req, self._clock())
                    first.append(req)
                room = req.sampling.max_tokens - n_out
                kept = min(n_new, max(room, 0))
                start = ends[i] - n_new
                new = [int(t) for t in toks[start : start + kept]]
                extend_output(req, new)
                n_out += kept
                dropped += n_new - kept
                if new:
                    deltas.append(RowTokens(req, None, new))
                if n_new == 1 and n_out < req.check_out:
                    continue
            slow.append(req)  # several tokens, or a prefill chunk ran: blocks to cache
        return dropped

    def _after_report(self, req: Request, finish_reason: int) -> None:
        """The slow path of a report row: caching, hand-off, finish, block extension."""
        exits = self._exits
        if req.status == RequestStatus.PREEMPTED:
            # It finished before the worker saw the preempt: keep that; the ack is ignored.
            if finish_reason:
                exits.finish(req, FinishReason(finish_reason))
            elif req.num_output_tokens >= req.sampling.max_tokens:
                exits.finish(req, FinishReason.LENGTH)
            return
        out, reported = current(req)
        capacity = len(req.block_ids) * self._block_size
        if reported > capacity:
            raise ProtocolError(
                f"handle {req.handle}: reported {reported} KV positions but its "
                f"table holds {capacity}"
            )
        self._kv.cache_reported(req)
        self._backlog.charge_output(req)
        n_out = len(out)
        if finish_reason:
            ho = self.stored_hand_offs
            if ho is not None and finish_reason == FinishReason.LENGTH and ho.placed_one(req):
                ho.begin(req, dropped=True)  # its placement's max_tokens 1, not the request's
            else:
                exits.finish(req, FinishReason(finish_reason))
            return
        if n_out >= req.sampling.max_tokens:
            exits.finish(req, FinishReason.LENGTH)
            return
        table, threshold = self._table, self._outbox.threshold
        if n_out and self._prefill_role:
            if self.stored_hand_offs is not None:
                self.stored_hand_offs.begin(req)
            else:
                exits.hand_off(req, kv_sent=req.handle not in self._push_failed)
            return
        if self._prefill_role:
            table.set_check_at(req, threshold)  # its first token is a hand-off: it never decodes
            return
        if req.num_computed_tokens >= req.num_prefill_tokens:  # prefill done: decoding
            if capacity - len(req.prompt_token_ids) - n_out <= threshold + self._spec_k:
                # Room is low: extend it now (sent with the next Tasks) if the pool has the
                # blocks; else the next schedule() makes room (or preempts), and until then it
                # needs a visit only for its first token, at max_tokens, or when its ring fills.
                new = None if exits.paused else table.grow(req, threshold)
                if new is None:
                    table.need_blocks(req)
                    table.set_check(req, req.sampling.max_tokens if n_out else 1)
                    return
                table.blocks_met(req)  # (an earlier visit found it dry)
                if new:
                    self._outbox.extend(Extension(req.handle, new))
            table.set_check_at(req, threshold)


def _count_drafts(
    report: StepReport, get: Callable[[int], Request | None], stats: SchedulerStats
) -> None:
    """Add each drafted row's verified and accepted drafts to its request and the instance's
    counters (rows about a request gone are dropped, as its tokens are)."""
    for h, d, a in zip(
        report.draft_handles, report.num_draft_tokens, report.num_accepted_drafts, strict=True
    ):
        req = get(int(h))
        if req is not None:
            drafts, accepted = int(d), min(int(a), int(d))
            req.num_draft_tokens += drafts
            req.num_accepted_drafts += accepted
            stats.count_drafts(drafts, accepted)


def put_logprobs(report: StepReport, get: Callable[[int], Request | None]) -> None:
    """A report's log-probability rows into its live requests' `logprobs`, by output position
    (before its tokens are applied: row j of a handle's row i is output token
    len(output) + j; a merged report's later rows of the same handle follow on)."""
    pos: dict[int, int] = {}
    if report.num_logprobs and report.logprobs is not None:
        runs = report.logprobs.split(list(report.num_logprobs))
        handles = report.handles
        for i, rows in enumerate(runs):
            if not rows or (req := get(int(handles[i]))) is None or req.logprobs is None:
                continue
            start = pos.get(req.handle)
            if start is None:
                start = len(req.output_token_ids)
            req.logprobs.put(start, rows)
            pos[req.handle] = start + len(rows)
    if report.prompt_logprob_handles and report.prompt_logprobs is not None:
        runs = report.prompt_logprobs.split(list(report.num_prompt_logprobs))
        for h, rows in zip(report.prompt_logprob_handles, runs, strict=True):
            lp = req.logprobs if (req := get(int(h))) is not None else None
            if lp is not None and lp.prompt is None:  # (once: a re-placement recomputes it)
                lp.prompt = rows
