"""Admission and the step's budget: new requests into the queue (`add_request`), and the three
pieces of a step that spend the budget, in order: block extensions for decoders
(`_extend_decoders`), the next chunks of prompts already admitted (`_continue_prefills`), new
admissions from the queue (`_admit`).

A worker step's token budget (`StepBudget`):

    max_num_batched_tokens = decoding x (1 + k)  +  continuing prefill chunks  +  new prefills
                             (worker-autonomous)    (admission order)            (queue order)

where the prefill chunks count those sent earlier and not yet executed (`step_plan`): the budget
bounds what one worker step runs, not what one schedule() call sends. While requests decode, a
second limit: the step-cost model's predicted step time stays under `itl_target_ms`.

Imported by the scheduler facade only; imports `preemption` (and through it `placement`),
`step_plan` and `validation`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.config import Role
from kvsched.core.errors import CapacityExceeded
from kvsched.core.protocol import Chunk, Extension, FinishReason, Tasks
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.deadlines import Deadlines
from kvsched.core.scheduler.preemption import Preemption
from kvsched.core.scheduler.step_plan import PIPELINE_DEPTH
from kvsched.core.scheduler.validation import validate


@dataclass(slots=True)
class StepBudget:
    """What one schedule() call may still hand out, spent as it goes."""

    tokens: int  # prefill tokens left (after the decoders' and the outstanding chunks' share)
    encoder: int = -1  # multimodal encoder tokens left; -1: unlimited
    preempted: bool = False  # something was preempted this step: admit nothing new
    # Predicted milliseconds the ITL target leaves for new prefill (inf: no time limit);
    # computed when the first chunk is sized (a steady decode step never needs it).
    slack_ms: float | None = None
    # The oldest prompt (`floor_for`; None: the first one sized) may take this many tokens even
    # when the time target leaves none, so prompts always progress (then 0).
    floor: int = 0
    floor_for: Request | None = None
    floor_ms: float = 0.0  # slack held back for floor_for's floor chunk until it is sized


def _prefill_left(req: Request) -> int:
    return req.num_prefill_tokens - req.num_computed_tokens


class Admission(Preemption, Deadlines):
    """New requests in, and the step's pieces that spend a `StepBudget`."""

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises InvalidRequest (bad fields, duplicate id) or
        CapacityExceeded (the queue is at max_waiting); state is unchanged when it raises."""
        validate(req, self.config, self.requests, self.kv.pool.num_blocks)
        if len(self.waiting) >= self.config.scheduler.max_waiting:
            raise CapacityExceeded(
                f"waiting queue is full ({self.config.scheduler.max_waiting} requests); "
                "retry later or raise scheduler.max_waiting"
            )
        req.status = RequestStatus.WAITING
        if req.arrival_time == 0.0:
            req.arrival_time = self.clock()
        self._check_deadline(req)  # may shed it (CapacityExceeded) or demote it
        self.requests[req.req_id] = req
        self.waiting.push(req)

    def _step_budget(self) -> StepBudget:
        sc = self.config.scheduler
        if self._out:
            self._prune_outstanding()
        tokens = sc.max_num_batched_tokens - self.num_decoding * (1 + self._spec_k)
        tokens -= self._out_tokens
        return StepBudget(tokens, sc.max_num_encoder_tokens or -1, floor=sc.min_prefill_chunk)

    # ==== the pieces of a step ================================================================
    def _extend_decoders(self, tasks: Tasks, budget: StepBudget) -> None:
        """Give decoding requests whose room is low `prealloc_blocks` more blocks (one more
        with speculative decoding); preempt LIFO when the pool runs dry. Extensions made by
        report visits since the last step go out first."""
        if self._extended:
            # Made at report time (`_after_report`); drop those whose request left its handle
            # since (finished, aborted, preempted): their blocks went back with it.
            live = self.live
            tasks.extensions = [
                e
                for e in self._extended
                if (r := live.get(e.handle)) is not None and r.status == RequestStatus.RUNNING
            ]
            self._extended = []
        needs = self.needs_blocks
        while needs:
            req = next(iter(needs.values()))
            while (new := self._grow(req)) is None:
                if len(self.running) == 1:
                    # Alone and the pool is full: it can never grow here, and preempting it
                    # would only recompute into the same wall. End it as the model's length
                    # (the worker drops it with the abort in this same Tasks message).
                    pool = self.kv.pool
                    self._pending_aborts.append(req.handle)
                    self._finish(
                        req,
                        FinishReason.LENGTH,
                        f"KV cache full: the instance holds {pool.num_blocks} blocks "
                        f"({pool.num_blocks * self.block_size} tokens)",
                    )
                    break
                budget.preempted = True
                if self._preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # it was the victim (and left needs_blocks)
            del needs[req.req_id]
            if new:
                tasks.extensions.append(Extension(req.handle, new))
            self._set_check_at(req)

    def _continue_prefills(self, tasks: Tasks, budget: StepBudget) -> None:
        continuing = list(self.prefilling.values())
        if continuing and self._slack_bound(budget):
            # The time target limits the step: the prompt with the least prefill left goes
            # first (a queue head too, admitted ahead when it has less left than every prompt
            # in), so one long prompt's chunks do not hold every short prompt behind it for
            # seconds. The oldest prompt keeps the floor chunk: none starves.
            budget.floor_for = oldest = continuing[0]
            self._reserve_floor(oldest, budget)
            # Ordered by class, then overdue prompts by deadline, then least left (deadlines).
            continuing = self.prefill_order(continuing)
            if self.waiting and not budget.preempted:
                shortest = min(map(_prefill_left, continuing))
                self._admit(tasks, budget, max_prompt=shortest - 1)
        for req in continuing:
            if req.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if self._outstanding_of(req)[0] >= PIPELINE_DEPTH:
                if req is budget.floor_for or budget.floor_for is None:
                    budget.floor = 0  # it runs a chunk in each of the next steps: progress
                continue
            n = self._chunk_size(req, req.num_computed_tokens, budget)
            if n <= 0:
                continue
            end = req.num_computed_tokens + n
            while (new := self.kv.allocate_slots(req, self._alloc_target(req, end))) is None:
                budget.preempted = True
                if self._preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            assert new is not None
            if new:
                tasks.extensions.append(Extension(req.handle, new))
                self._prefill_debt -= len(new)
            self._emit_chunk(tasks, req, n, budget)

    def _admit(self, tasks: Tasks, budget: StepBudget, max_prompt: int = -1) -> None:
        """Admit from the queue's head while the budget lasts (max_prompt: only heads with at
        most this many tokens left to prefill)."""
        while budget.tokens > 0 and self.free_slots and (req := self.waiting.peek()) is not None:
            if self.config.role == Role.DECODE and not req.output_token_ids:
                break  # a decode instance takes new prompts only through add_prefilled
            hits = self.kv.find_cached_prefix(req)
            # The host tier continues the GPU hits (swap-ins into fresh blocks, if cheaper than
            # recomputing those tokens: `_host_hits`).
            host_hits = self.kv.find_host_run(req, len(hits)) if self.kv.host else []
            num_hit = self._trim_hits_for_mm(req, (len(hits) + len(host_hits)) * self.block_size)
            hits = hits[: num_hit // self.block_size]
            declined = 0
            if host_hits:
                host_hits, declined = self._host_hits(len(hits), host_hits, num_hit)
                num_hit = (len(hits) + len(host_hits)) * self.block_size
            if max_prompt >= 0 and req.num_tokens - num_hit > max_prompt:
                break
            n = self._chunk_size(req, num_hit, budget, num_prefill=req.num_tokens)
            if n <= 0:
                break
            target = self._alloc_target(req, num_hit + n, num_prefill=req.num_tokens)
            need = self.kv.num_blocks_to_allocate(req, target, hits)
            if self.config.scheduler.admit_full_prompt or max_prompt >= 0:
                # Admit only what can finish its prefill: the whole prompt must fit beside the
                # rest of the prompts already admitted, or its later chunks preempt decoders.
                # (Always so ahead of the continuing prompts: their chunks then find their
                # blocks, and never preempt the request placed just now.)
                full = self._alloc_target(req, req.num_tokens, num_prefill=req.num_tokens)
                need = self.kv.num_blocks_to_allocate(req, full, hits) + self._prefill_debt
            reserve = self.reserve_blocks_per_running * len(self.running)
            if need + reserve > self.kv.num_free_blocks:
                if not self._priority_preempt_for(req):
                    break
                continue
            self.waiting.pop()
            self._on_admitted(req, num_hit)
            host = self.kv.host
            if host is not None and host_hits:  # pinned before this allocation evicts
                host.pin(host_hits)
            new = self.kv.allocate_slots(req, target, hits)
            assert new is not None
            self._prefill_debt += self._full_blocks(req, req.num_tokens) - len(req.block_ids)
            self._place(tasks, req, num_hit, len(host_hits) * self.block_size)
            if host is not None and host_hits:  # into the fresh blocks after the GPU hits
                host.copy_in(req.handle, host_hits, new[: len(host_hits)])
            elif host is not None and declined:
                host.stats.swap_ins_declined += declined
            self._emit_chunk(tasks, req, n, budget)

    def _host_hits(
        self, num_gpu_hits: int, host_hits: list[int], num_hit: int
    ) -> tuple[list[int], int]:
        """The host hits worth swapping in: those within num_hit (multimodal trimming), none
        when the step-cost model predicts copying them costs at least recomputing them.
        Returns them and how many were declined."""
        bs = self.block_size
        host_hits = host_hits[: max(0, num_hit // bs - num_gpu_hits)]
        n, prefix = len(host_hits) * bs, num_gpu_hits * bs
        a_tok, a_attn = self.cost.prefill_costs
        if self.cost.swap_block_ms * len(host_hits) >= a_tok * n + a_attn * n * (n + prefix):
            return [], len(host_hits)
        return host_hits, 0

    def _reserve_floor(self, req: Request, budget: StepBudget) -> None:
        """Hold back the time of req's floor chunk before shorter prompts take the slack, so
        the floor exceeds the target only when the decodes leave less than it."""
        count, own_tokens, own_attn = self._outstanding_of(req)
        if count >= PIPELINE_DEPTH or budget.slack_ms is None:
            return
        start = req.num_computed_tokens
        n = min(budget.floor, _prefill_left(req))
        cost = self._chunk_extra_ms(start, n, own_tokens, own_attn)
        budget.floor_ms = max(0.0, min(cost, budget.slack_ms))
        budget.slack_ms -= budget.floor_ms

    def _slack_bound(self, budget: StepBudget) -> bool:
        """The time target limits this step's prefill (computed once per step)."""
        if budget.slack_ms is None:
            budget.slack_ms = self._time_slack_ms()
        return budget.slack_ms != float("inf")

    # ==== chunks ==============================================================================
    def _chunk_size(
        self, req: Request, start: int, budget: StepBudget, num_prefill: int | None = None
    ) -> int:
        """Tokens of req's prefill to run this step starting at `start`, or 0 if none fit."""
        sc = self.config.scheduler
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        remaining = total - start
        # A chunk no larger than req's own outstanding ones adds nothing to any worker step.
        _, own_tokens, own_attn = self._outstanding_of(req)
        n = min(remaining, budget.tokens + own_tokens)
        if sc.long_prefill_token_threshold:
            n = min(n, sc.long_prefill_token_threshold)
        if sc.disable_chunked_prefill and n < remaining:
            return 0
        if n > 0:
            if budget.slack_ms is None:
                budget.slack_ms = self._time_slack_ms()
            if req is budget.floor_for:
                budget.slack_ms += budget.floor_ms  # its floor was held back for it
                budget.floor_ms = 0.0
            n_time = self._fit_time(start, n, own_tokens, own_attn, budget.slack_ms)
            if budget.floor and (budget.floor_for is None or budget.floor_for is req):
                n_time = max(n_time, min(n, budget.floor))  # never starve: the oldest progresses
                budget.floor = 0
            n = n_time
        if req.mm_ranges:
            n = self._trim_chunk_for_mm(req, start, n, budget.encoder)
        return n

    def _trim_chunk_for_mm(self, req: Request, start: int, n: int, enc_left: int) -> int:
        """Never end a chunk inside an image range (disable_chunked_mm_input), and keep the
        step's multimodal tokens within the encoder budget (`enc_left`, -1: unlimited): roll
        back to the range start. With the encoder cache on, only misses cost budget (the whole
        item, encoded at once; one larger than the budget runs alone in a step) and a miss
        needs room in the cache."""
        sc = self.config.scheduler
        enc = self.enc
        end = start + n
        missed: dict[str, int] = {}  # the chunk's misses so far and their sizes
        touched: set[str] = set()  # every item the chunk reads: none is evicted for it
        for r in req.mm_ranges:
            r_end = r.offset + r.length
            if r_end <= start or r.offset >= end:
                continue
            if sc.disable_chunked_mm_input and r.offset < end < r_end:
                end = max(r.offset, start)
                break
            if enc is not None:
                h = r.content_hash
                if h in enc or h in missed:
                    touched.add(h)
                    continue
                full = sc.max_num_encoder_tokens
                if enc_left >= 0 and r.length > enc_left and not (enc_left == full and not missed):
                    end = max(r.offset, start)
                    break
                if not enc.can_fit(sum(missed.values()) + r.length, self._enc_needed, touched):
                    end = max(r.offset, start)
                    break
                missed[h] = r.length
                touched.add(h)
                enc_left -= r.length if enc_left >= 0 else 0
                continue
            used = min(r_end, end) - max(r.offset, start)
            if enc_left >= 0 and used > enc_left:
                end = max(r.offset, start)
                break
            enc_left -= used if enc_left >= 0 else 0
        return end - start

    def _use_encoder_budget(self, req: Request, start: int, end: int, budget: StepBudget) -> None:
        enc = self.enc
        if enc is not None:  # the items the chunk reads: misses pay, hits are free
            ranges = [r for r in req.mm_ranges if r.offset < end and r.offset + r.length > start]
            # Hits first: once this request uses them, no miss below evicts them (as sized).
            ranges.sort(key=lambda r: r.content_hash not in enc)
            for r in ranges:
                miss = enc.use(req, r.content_hash, r.length, self._enc_needed)
                if miss and budget.encoder >= 0:  # (a lone larger item leaves 0)
                    budget.encoder = max(0, budget.encoder - r.length)
            return
        if budget.encoder < 0:
            return
        for r in req.mm_ranges:
            budget.encoder -= max(0, min(r.offset + r.length, end) - max(r.offset, start))

    def _trim_hits_for_mm(self, req: Request, num_hit: int) -> int:
        """A prefix hit may not end inside an image range when chunked mm input is disabled:
        roll it back to the block boundary at or before the range start (the seed's
        revert_chunked_mm_input)."""
        if not (req.mm_ranges and self.config.scheduler.disable_chunked_mm_input):
            return num_hit
        bs = self.block_size
        for r in sorted(req.mm_ranges, key=lambda r: r.offset, reverse=True):
            if r.offset < num_hit < r.offset + r.length:
                num_hit = (r.offset // bs) * bs
        return num_hit

    def _emit_chunk(self, tasks: Tasks, req: Request, n: int, budget: StepBudget) -> None:
        start = req.num_computed_tokens
        _, own_tokens, own_attn = self._outstanding_of(req)
        budget.tokens -= max(0, n - own_tokens)
        if budget.slack_ms is not None:
            budget.slack_ms -= self._chunk_extra_ms(start, n, own_tokens, own_attn)
        self._record_chunk(req, start, n)
        tasks.chunks.append(Chunk(req.handle, start, req.token_ids(start, start + n)))
        req.num_computed_tokens = start + n
        if req.mm_ranges:
            self._use_encoder_budget(req, start, start + n, budget)
        if req.num_computed_tokens >= req.num_prefill_tokens:
            del self.prefilling[req.req_id]
            self.num_decoding += 1
            self._set_check_at(req)
        self._on_chunk(req, start, n)
