"""Planning per worker step: the prefill chunks sent and not yet executed, the step-cost model
fed from every report, and the two limits a new chunk must keep for every step it may land in.

Why per worker step and not per `schedule()` call: `schedule()` runs after every report and
every arrival, and its chunks wait about two steps in the worker, which runs one queued chunk per
prefilling request per step. A fresh budget per call would let one worker step run the chunks of
several calls at once. The worker never runs two chunks of one request in a step, so a step's
prefill is at most, summed over requests, the largest chunk each has sent and not yet seen
reported ("outstanding"). Keeping

    decoding x (1 + k) + sum over requests of (largest outstanding chunk)  <=  max_num_batched_tokens
    model(decodes, their context, sum of largest chunks, sum of largest c * (c + prefix))  <=  itl_target_ms

bounds every worker step by construction, whatever the timing of reports and arrivals. A
request may have `PIPELINE_DEPTH` chunks outstanding, so its next chunk is already queued when
the worker finishes one (two steps in flight); a further chunk no larger than its outstanding
ones costs no extra budget. The report that shows a chunk ran (its row's num_computed reaches
the chunk's end) frees its share, and its terms are the features of that measured step.

A request's oldest outstanding chunk runs in the worker's current step, before anything
planned now can land, once the worker has applied it: then it no longer counts. Applied is
known for sure from a report's applied_seq, a step late, which would leave every other step
without prefill; so while the measured round trip (`Outbox.lag`) is the protocol's two
steps, every chunk sent before the latest report is taken as applied at the step boundary that
report's step was followed by (it was sent while the worker ran the step before), and only
when the control plane falls behind does the report's applied_seq decide.

`StepPlan` owns the model and the outstanding chunks; it reads the placement table (who is
live, how many decode) and the outbox (the message seq, the round trip). The admitter spends
its limits, the report applier feeds it (`learn_step`). Imports `table`, `outbox`, `step_cost`.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from kvsched.core.config import EngineConfig
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import StepReport
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.step_cost import StepCostModel

# Chunks of one request in flight at once: the one the worker runs now and the next, queued.
PIPELINE_DEPTH = 2
# Worker steps between planning a chunk and running it (two steps in flight): decoding
# contexts grow by this many tokens meanwhile.
LOOKAHEAD_STEPS = 2
_add_reduce = np.add.reduce


class Outstanding:
    """The chunks of one placement sent to the worker and not yet reported executed."""

    __slots__ = ("attn", "chunks", "final_end", "head_running", "req", "tokens")

    def __init__(self, req: Request) -> None:
        self.req = req
        # (end, length c, c * (c + prefix), seq of the Tasks that carried it), oldest first
        self.chunks: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self.head_running = False  # the oldest was applied by the worker: it runs now
        self.tokens = 0  # the largest length among the chunks that count (see module doc)
        self.attn = 0  # the largest c * (c + prefix) among them
        self.final_end = 0  # the prompt's last chunk is among them: its end (else 0)


class StepPlan:
    """Owns the step-cost model (`cost`) and the outstanding chunks of each placement."""

    def __init__(
        self, config: EngineConfig, table: PlacementTable, outbox: Outbox, kv: KVCacheManager
    ) -> None:
        self._table, self._outbox, self._kv = table, outbox, kv
        self._spec_k = config.speculative.num_speculative_tokens
        sc, scc = config.scheduler, config.step_cost
        self.cost = StepCostModel(scc.seed(), scc.forgetting)
        # Whole prompts (disable_chunked_prefill) cannot be cut to a time: tokens only.
        self.itl_target_ms = 0.0 if sc.disable_chunked_prefill else sc.itl_target_ms
        self.target_now_ms = self.itl_target_ms  # the step target last planned to (stretched?)
        self.num_steps_over_target = 0  # measured steps with decodes longer than itl_target_ms
        self._drain_steps = sc.queue_drain_steps
        self._floor = sc.min_prefill_chunk
        self._out: dict[int, Outstanding] = {}  # handle -> its outstanding chunks
        self._out_slot = np.full(table.slots.size, -1, dtype=np.int64)  # slot -> handle in _out
        self._out_tokens = 0  # sum of Outstanding.tokens
        self._out_attn = 0  # sum of Outstanding.attn
        self._out_final_ctx = 0  # sum of Outstanding.final_end: they decode soon
        # The decoding context of the last single-step report (decode rows' num_computed, plus
        # the prompts it completed), what the next steps start from.
        self._decode_ctx = 0
        self.last_step_terms: tuple[int, int, int, int] = (0, 0, 0, 0)

    def view(self) -> dict[str, Any]:
        """The model's figures for `SchedulerSnapshot` (read only: learning does not depend on
        who looks)."""
        cost = self.cost
        return {
            "step_predicted_ms": cost.last_predicted_ms,
            "step_measured_ms": cost.last_measured_ms,
            "step_predicted_ewma_ms": cost.ewma_predicted_ms,
            "step_measured_ewma_ms": cost.ewma_measured_ms,
            "step_cost_coefficients": cost.coefficients,
            "itl_target_ms": self.itl_target_ms,
            "step_target_ms": self.target_now_ms,
            "num_steps_over_target": self.num_steps_over_target,
        }

    # ==== admission's side ====================================================================
    @property
    def has_outstanding(self) -> bool:
        return bool(self._out)

    @property
    def decode_ctx(self) -> int:
        return self._decode_ctx

    def outstanding_tokens(self) -> int:
        """Prefill tokens the chunks in flight take from every coming worker step (placements
        that ended are forgotten first)."""
        if self._out:
            self._prune()
        return self._out_tokens

    def outstanding_of(self, req: Request) -> tuple[int, int, int]:
        """(chunks, largest length, largest attention term) req has outstanding."""
        rec = self._out.get(req.handle)
        if rec is None or rec.req is not req:
            return 0, 0, 0
        return len(rec.chunks), rec.tokens, rec.attn

    def step_target_ms(self, decode_ms: float, claim_ms: float) -> float:
        """The time a coming step may take: `itl_target_ms`, or, while prompts wait, the
        decodes' time (decode_ms) plus 1/`queue_drain_steps` of the waiting prompts' claim
        (claim_ms: their prefill, each counted up to one floor chunk, less the one prompt the
        floor serves anyway, `Backlog.drain_claim_ms`), when longer. So a burst is taken in a
        few steps that shrink as the queue empties. Without it, decodes that fill the target left prompts one floor chunk
        per step, slower than requests finish: the decode batch shrank and the queue grew
        (step-bound model, c=64: 43 of 64 rows decoding). (Taking all of a claim no larger
        than a floor chunk at once as well was tried: worse at c=16 and no better at c=64.)"""
        target = self.itl_target_ms
        if self._drain_steps and claim_ms > 0:
            return max(target, decode_ms + claim_ms / self._drain_steps)
        return target

    def new_pass(self) -> None:
        """A schedule() pass begins: its step target is itl_target_ms unless the pass
        stretches it (`time_slack_ms`, called only when prompts are to be placed)."""
        self.target_now_ms = self.itl_target_ms

    @property
    def floor_ms(self) -> float:
        """Predicted milliseconds of a floor chunk (min_prefill_chunk tokens from position 0)."""
        return self.chunk_extra_ms(0, self._floor, 0, 0)

    def time_slack_ms(self, claim_ms: float = 0.0) -> float:
        """Milliseconds the step target (`step_target_ms`, claim_ms: the waiting prompts'
        claim) leaves for new prefill in the steps being planned; inf when the target is off
        or nothing decodes (then only the token budget applies)."""
        d = self._table.num_decoding
        if self.itl_target_ms <= 0 or d <= 0:
            return float("inf")
        ctx = self._decode_ctx + self._out_final_ctx + LOOKAHEAD_STEPS * d
        copies = self._kv.num_queued_copies  # they run at the step's boundary
        fetches = self._kv.num_queued_fetches
        step_ms = self.cost.predict_ms(
            self._out_tokens + d * self._spec_k, d, ctx, self._out_attn, copies, fetches
        )
        a_tok, a_attn = self.cost.prefill_costs  # the model is linear: the decodes' share
        decode_ms = step_ms - a_tok * self._out_tokens - a_attn * self._out_attn
        self.target_now_ms = target = self.step_target_ms(decode_ms, claim_ms)
        return target - step_ms

    def storage_write_budget(self) -> int:
        """Storage writes a step hides: they run beside it (the worker's NIC reads pinned host
        memory while the GPU computes), so a message carries at most a typical step's
        measured time (the itl target before any was measured) of them, by the cost model's
        per-block storage transfer time; never fewer than one."""
        step_ms = self.cost.ewma_measured_ms or self.itl_target_ms or 50.0
        per_block = self.cost.fetch_block_ms
        return max(1, int(step_ms / per_block)) if per_block > 0 else 1 << 30

    def fit_time(self, start: int, n: int, own_tokens: int, own_attn: int, slack: float) -> int:
        """The largest chunk m <= n starting at `start` whose extra predicted cost fits `slack`
        (ms), given the request's own outstanding largest chunk (a chunk no larger costs none)."""
        if slack == float("inf"):
            return n
        a_tok, a_attn = self.cost.prefill_costs

        def extra(m: int) -> float:
            return a_tok * max(0, m - own_tokens) + a_attn * max(0, m * (m + start) - own_attn)

        if extra(n) <= slack:
            return n
        lo, hi = 0, n  # extra(lo) fits (or lo == 0), extra(hi) does not
        if slack < 0:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if extra(mid) <= slack:
                lo = mid
            else:
                hi = mid
        return lo

    def chunk_extra_ms(self, start: int, n: int, own_tokens: int, own_attn: int) -> float:
        a_tok, a_attn = self.cost.prefill_costs
        return a_tok * max(0, n - own_tokens) + a_attn * max(0, n * (n + start) - own_attn)

    def record_chunk(self, req: Request, start: int, n: int) -> None:
        """req was sent prefill positions [start, start + n): outstanding until reported."""
        h = req.handle
        rec = self._out.get(h)
        if rec is None or rec.req is not req:
            rec = self._out[h] = Outstanding(req)
            self._out_slot[req.slot] = h
        attn = n * (n + start)
        end = start + n
        rec.chunks.append((end, n, attn, self._outbox.seq))
        if n > rec.tokens:
            self._out_tokens += n - rec.tokens
            rec.tokens = n
        if attn > rec.attn:
            self._out_attn += attn - rec.attn
            rec.attn = attn
        if end >= req.num_prefill_tokens:
            rec.final_end = end
            self._out_final_ctx += end

    def _prune(self) -> None:
        """Forget the chunks of placements that ended (finished, aborted, preempted, handed
        off): the worker drops them no later than any task planned now can land."""
        live = self._table.live
        for h, rec in list(self._out.items()):
            if live.get(h) is not rec.req or rec.req.status != RequestStatus.RUNNING:
                self._drop(h, rec)

    def _drop(self, h: int, rec: Outstanding) -> None:
        self._out_tokens -= rec.tokens
        self._out_attn -= rec.attn
        self._out_final_ctx -= rec.final_end
        del self._out[h]
        slot = rec.req.slot
        if slot >= 0 and self._out_slot[slot] == h:
            self._out_slot[slot] = -1
        else:  # the slot was given up: find it by handle (rare)
            self._out_slot[self._out_slot == h] = -1

    # ==== the report's side ===================================================================
    def learn_step(
        self,
        report: StepReport,
        h: np.ndarray,
        s: np.ndarray,
        single: bool,
        swaps: int,
        fetches: int = 0,
    ) -> None:
        """Before the report's rows are applied: mark the chunks it shows executed, and learn
        the step's measured time from its terms (h, s: the rows' handles and slots; single:
        the report is of one step, not a merge of several; swaps: host tier copies done at
        the step's boundary, the model's swapped-blocks term; fetches: storage tier fetches done
        there, its fetched-blocks term)."""
        prefill = attn = n_prefill_rows = prefill_comp = completed_ctx = 0
        comps = report.num_computed
        if self._out:
            out = self._out
            for i in np.flatnonzero(self._out_slot[s] == h).tolist():
                rec = out.get(int(h[i]))
                if rec is None:
                    continue
                done = int(comps[i])
                n_prefill_rows += 1
                prefill_comp += done
                chunks = rec.chunks
                while chunks and chunks[0][0] <= done:
                    end, c, a, _ = chunks.popleft()
                    prefill += c
                    attn += a
                    if end == rec.final_end:
                        completed_ctx += end
                        self._out_final_ctx -= end
                        rec.final_end = 0
            # Two steps in flight (a Tasks message is applied two reports after the one it
            # answers): everything sent so far is applied at the boundary of the current step.
            outbox = self._outbox
            applied = outbox.seq if outbox.lag <= 2 else report.applied_seq
            for hk, rec in list(out.items()):
                self._shrink(hk, rec, applied)
        if not single:
            return  # a merged report: its time is the last step's, its rows several steps'
        # (np.add.reduce: the array method's dispatch costs more than the sum itself.)
        total = int(_add_reduce(comps)) if isinstance(comps, np.ndarray) else sum(comps)
        decodes = len(h) - n_prefill_rows
        ctx = total - prefill_comp
        self._decode_ctx = ctx + completed_ctx
        self.last_step_terms = (prefill, decodes, ctx, attn)
        if report.step_time_ns > 0:
            ms = report.step_time_ns / 1e6
            self.cost.observe(prefill, decodes, ctx, attn, swaps, ms, fetches)
            if decodes and 0 < self.itl_target_ms < ms:
                self.num_steps_over_target += 1  # a decode stall past the target, whatever why

    def _shrink(self, h: int, rec: Outstanding, applied_seq: int) -> None:
        """Recompute a record's largest chunks after a report (some ran, the oldest may be
        running now); drop it when none is left."""
        chunks = rec.chunks
        if not chunks:
            self._drop(h, rec)
            return
        rec.head_running = chunks[0][3] <= applied_seq
        tokens = attn = 0
        for i, (_, c, a, _) in enumerate(chunks):
            if i == 0 and rec.head_running:
                continue
            tokens = max(tokens, c)
            attn = max(attn, a)
        self._out_tokens += tokens - rec.tokens
        self._out_attn += attn - rec.attn
        rec.tokens, rec.attn = tokens, attn
