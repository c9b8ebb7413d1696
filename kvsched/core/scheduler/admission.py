"""The admitter: one per `schedule()` call, built with the step's collaborators and its budget
(the shape of mini-sglang's PrefillAdder: it owns the step's budget and decides). Three pieces
spend the budget, in order: block extensions for decoders (`extend_decoders`), the next chunks
of prompts already admitted (`continue_prefills`), new admissions from the queue (`admit`).

A worker step's token budget (`StepBudget`):

    max_num_batched_tokens = decoding x (1 + k)  +  continuing prefill chunks  +  new prefills
                             (worker-autonomous)    (admission order)            (queue order)

where the prefill chunks count those sent earlier and not yet executed (`step_plan`): the budget
bounds what one worker step runs, not what one schedule() call sends. While requests decode, a
second limit: the step-cost model's predicted step time stays under `itl_target_ms`.

Every change it makes goes through an owner: slots and sets through the placement table,
the queue and its backlog through `Backlog`, preemptions and ends through `Exits`, chunk
records through `StepPlan`; it writes only its own budget and the Tasks it fills. Multimodal
prompts' chunk and hit boundaries and their encoder cost are `multimodal`'s functions. Imported
by the scheduler facade only; imports `table`, `step_plan`, `backlog`, `exits`, `outbox`,
`events`, `multimodal`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import kvsched.core.lifecycle as lifecycle
from kvsched.core.config import EngineConfig, PdTransfer, Role
from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager, prefills_at_once
from kvsched.core.protocol import Chunk, Extension, FinishReason, KvSend, Placement, Tasks
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import Events, SchedulerStats
from kvsched.core.scheduler.exits import Exits
from kvsched.core.scheduler.multimodal import charge_encoder, trim_chunk, trim_hit
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.pd_storage import StorageHandOffs
from kvsched.core.scheduler.step_plan import PIPELINE_DEPTH, StepPlan
from kvsched.core.scheduler.table import PlacementTable


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


# Queue heads one admission pass sets aside for their LoRA adapter at most (vLLM scans its whole
# waiting queue; a bound keeps a step's work bounded when thousands wait for busy adapters).
_MAX_SKIPPED = 256


def _prefill_left(req: Request) -> int:
    return req.num_prefill_tokens - req.num_computed_tokens


class Admitter:
    """One schedule() call's admissions: owns the step's `StepBudget` and the Tasks it fills."""

    __slots__ = (
        "_stored_hand_off",
        "backlog",
        "block_size",
        "budget",
        "clock",
        "config",
        "enc",
        "events",
        "exits",
        "hold_until",
        "kv",
        "outbox",
        "plan",
        "stats",
        "table",
        "tasks",
    )

    def __init__(
        self,
        config: EngineConfig,
        tasks: Tasks,
        table: PlacementTable,
        kv: KVCacheManager,
        enc: EncoderCache | None,
        plan: StepPlan,
        backlog: Backlog,
        exits: Exits,
        outbox: Outbox,
        events: Events,
        stats: SchedulerStats,
        clock: Callable[[], float],
    ) -> None:
        self.clock = clock
        self.config, self.tasks, self.table, self.kv, self.enc = config, tasks, table, kv, enc
        self.plan, self.backlog, self.exits, self.outbox = plan, backlog, exits, outbox
        self.events, self.stats = events, stats
        self.hold_until: float | None = None  # the earliest end of a prefetch hold this step
        self.block_size = table.block_size
        self._stored_hand_off = (  # prefill role handing off through the store (pd_storage)
            config.role == Role.PREFILL and config.cache.pd_transfer == PdTransfer.STORAGE
        )
        sc = config.scheduler
        spec_k = config.speculative.num_speculative_tokens
        tokens = sc.max_num_batched_tokens - table.num_decoding * (1 + spec_k)
        tokens -= plan.outstanding_tokens()
        self.budget = StepBudget(
            tokens, sc.max_num_encoder_tokens or -1, floor=sc.min_prefill_chunk
        )

    # ==== the pieces of a step ================================================================
    def extend_decoders(self) -> None:
        """Give decoding requests whose room is low `prealloc_blocks` more blocks (one more
        with speculative decoding); preempt LIFO when the pool runs dry. Extensions made by
        report visits since the last step go out first."""
        tasks, budget, table, outbox = self.tasks, self.budget, self.table, self.outbox
        if outbox.extended:
            tasks.extensions = outbox.take_extended(table.live)  # (made at report time)
        needs = table.needs_blocks
        while needs:
            req = next(iter(needs.values()))
            while (new := table.grow(req, outbox.threshold)) is None:
                if len(table.running) == 1:
                    # Alone and the pool is full: it can never grow here, and preempting it
                    # would only recompute into the same wall. End it as the model's length
                    # (the worker drops it with the abort in this same Tasks message).
                    pool = self.kv.pool
                    outbox.abort(req.handle)
                    self.exits.finish(
                        req,
                        FinishReason.LENGTH,
                        f"KV cache full: the instance holds {pool.num_blocks} blocks "
                        f"({pool.num_blocks * self.block_size} tokens)",
                    )
                    break
                budget.preempted = True
                if self.exits.preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # it was the victim (and left needs_blocks)
            table.blocks_met(req)
            if new:
                tasks.extensions.append(Extension(req.handle, new))
            table.set_check_at(req, outbox.threshold)

    def continue_prefills(self) -> None:
        budget, table = self.budget, self.table
        continuing = list(table.prefilling.values())
        if continuing and self._slack_bound(budget):
            # The time target limits the step: the prompt with the least prefill left goes
            # first (a queue head too, admitted ahead when it has less left than every prompt
            # in), so one long prompt's chunks do not hold every short prompt behind it for
            # seconds. The oldest prompt keeps the floor chunk: none starves.
            budget.floor_for = oldest = continuing[0]
            self._reserve_floor(oldest, budget)
            # Ordered by class, then overdue prompts by deadline, then least left (deadlines).
            continuing = self.backlog.prefill_order(continuing)
            if self.backlog.waiting and not budget.preempted:
                shortest = min(map(_prefill_left, continuing))
                self.admit(max_prompt=shortest - 1)
        for req in continuing:
            if req.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if self.plan.outstanding_of(req)[0] >= PIPELINE_DEPTH:
                if req is budget.floor_for or budget.floor_for is None:
                    budget.floor = 0  # it runs a chunk in each of the next steps: progress
                continue
            n = self._chunk_size(req, req.num_computed_tokens)
            if n <= 0:
                continue
            end = req.num_computed_tokens + n
            while (new := self.kv.allocate_slots(req, table.alloc_target(req, end))) is None:
                budget.preempted = True
                if self.exits.preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            assert new is not None
            if new:
                self.tasks.extensions.append(Extension(req.handle, new))
                table.paid_debt(len(new))
            self._emit_chunk(req, n)

    def admit(self, max_prompt: int = -1) -> None:
        """Admit from the queue's head while the budget lasts (max_prompt: only heads with at
        most this many tokens left to prefill). A head whose LoRA adapter would make more than
        max_loras distinct adapters placed is skipped (as vLLM's scheduler skips it) and put
        back at the front afterwards, in its place."""
        skipped: list[Request] = []
        held: list[Request] = []  # waiting for their prefetch to land (core/prefetch.py)
        try:
            self._admit(max_prompt, skipped, held)
        finally:
            self.backlog.restore_skipped(skipped)
            for req in reversed(held):  # (ahead of the skipped: they were ahead of them)
                self.backlog.push_front(req)

    def _admit(self, max_prompt: int, skipped: list[Request], held: list[Request]) -> None:
        budget, table, kv, backlog = self.budget, self.table, self.kv, self.backlog
        waiting, free_slots = backlog.waiting, table.free_slots
        max_loras = self.config.scheduler.max_loras
        pf = kv.prefetch
        hold_s = self.config.cache.storage_prefetch_hold_ms / 1000.0
        while budget.tokens > 0 and free_slots and (req := waiting.peek()) is not None:
            if self.config.role == Role.DECODE and not req.output_token_ids:
                break  # a decode instance takes new prompts only through add_prefilled
            if max_loras and table.lora_blocked(req, max_loras):
                if len(skipped) >= _MAX_SKIPPED:
                    break  # (a bounded pass: the rest waits for the next step)
                skipped.append(backlog.skip_head())
                continue
            since = pf.pending_since(req) if hold_s and pf is not None else None
            if since is not None and self.clock() - since < hold_s:
                backlog.pop_head()  # back at the front afterwards, after the others' turn
                held.append(req)
                until = since + hold_s
                self.hold_until = until if self.hold_until is None else min(self.hold_until, until)
                continue
            # The host tier continues the GPU hits (swap-ins into fresh blocks, if cheaper than
            # recomputing those tokens: `_host_hits`), the storage tier the host hits (fetches
            # into fresh blocks after the swap-ins, likewise priced: `_storage_hits`).
            hits, host_hits, stored = kv.lookup(req)
            num_hit = (len(hits) + len(host_hits) + len(stored)) * self.block_size
            num_hit = trim_hit(req, num_hit, self.block_size, self.config.scheduler)
            hits = hits[: num_hit // self.block_size]
            declined = declined_fetches = 0
            if host_hits:
                host_hits, declined = self._host_hits(len(hits), host_hits, num_hit)
            if stored:
                stored, declined_fetches = self._storage_hits(
                    len(hits) + len(host_hits), stored, num_hit, bool(declined)
                )
            if host_hits or stored or declined or declined_fetches:
                num_hit = (len(hits) + len(host_hits) + len(stored)) * self.block_size
            if max_prompt >= 0 and req.num_tokens - num_hit > max_prompt:
                break
            n = self._chunk_size(req, num_hit, num_prefill=req.num_tokens)
            if n <= 0:
                break
            target = table.alloc_target(req, num_hit + n, num_prefill=req.num_tokens)
            need = kv.num_blocks_to_allocate(req, target, hits)
            if self.config.scheduler.admit_full_prompt or max_prompt >= 0:
                # Admit only what can finish its prefill: the whole prompt must fit beside the
                # rest of the prompts already admitted, or its later chunks preempt decoders.
                # (Always so ahead of the continuing prompts: their chunks then find their
                # blocks, and never preempt the request placed just now.)
                full = table.alloc_target(req, req.num_tokens, num_prefill=req.num_tokens)
                need = kv.num_blocks_to_allocate(req, full, hits) + table.prefill_debt
            reserve = self.exits.reserve_blocks_per_running * len(table.running)
            if need + reserve > kv.num_free_blocks:
                if not self.exits.priority_preempt_for(req):
                    break
                continue
            backlog.pop_head()
            backlog.on_admitted(req, num_hit)
            if host_hits:  # pinned before this allocation evicts
                kv.pin_host(host_hits)
            npf = 0  # host hits a prefetch brought (storage hits, off the step's path)
            if pf is not None and pf.has(req):
                if host_hits:
                    got = pf.landed_blocks(req)
                    npf = sum(1 for b in host_hits if b in got)
                kv.release_prefetch(req, npf)
            new = kv.allocate_slots(req, target, hits)
            assert new is not None
            table.admitted_debt(req)
            nh, ns = len(host_hits), len(stored)
            bs = self.block_size
            self._place(req, num_hit, (nh - npf) * bs, (ns + npf) * bs, npf * bs)
            if host_hits:  # into the fresh blocks after the GPU hits
                kv.swap_in(req.handle, host_hits, new[:nh])
            elif declined:
                kv.decline_swap_ins(declined)
            if stored:  # into the fresh blocks after the swapped-in ones
                kv.fetch(req.handle, stored, new[nh : nh + ns])
            elif declined_fetches:
                kv.decline_fetches(declined_fetches)
            if (nh or ns) and self._copies_ahead(nh, ns):
                if nh:
                    kv.host.stats.swap_ins_ahead += nh  # type: ignore[union-attr]
                if ns:
                    kv.storage.stats.fetches_ahead += ns  # type: ignore[union-attr]
                continue  # its first chunk goes in the next message (continue_prefills)
            self._emit_chunk(req, n)

    def _copies_ahead(self, num_swapped: int, num_fetched: int) -> bool:
        """Whether a placement's swap-ins and storage fetches go a message ahead of its first
        chunk (`CacheConfig.swap_in_ahead`): their predicted copy time is at least that share
        of the measured step (no step measured yet, or steps that take no time: yes)."""
        share = self.config.cache.swap_in_ahead
        if not share:
            return False
        cost = self.plan.cost
        step_ms = cost.ewma_measured_ms
        copy_ms = cost.swap_block_ms * num_swapped + cost.fetch_block_ms * num_fetched
        return copy_ms >= share * step_ms

    def _place(
        self,
        req: Request,
        num_hit: int,
        num_swapped: int,
        num_fetched: int = 0,
        num_prefetched: int = 0,
    ) -> None:
        """Give req a slot and a fresh handle (the table's); the worker learns it from a
        Placement. num_swapped: tokens of num_hit that swap-ins bring from the host tier;
        num_fetched: those that came from the storage tier (after them), num_prefetched of
        them prefetched into host blocks before this placement (swapped in)."""
        now = self.clock()
        lifecycle.place(req, now)  # (a request moved off a lost instance keeps its first time)
        if self.table.first_placement(req, num_hit, num_swapped, num_fetched):
            self.kv.record_lookup(req.num_tokens, num_hit, num_swapped, num_fetched, num_prefetched)
            self.stats.count_prompt(len(req.prompt_token_ids))
            if num_swapped or num_fetched:
                self.events.host_hits.append(req)
        self.table.place(req, num_hit, num_swapped + num_fetched)
        # The worker decodes from last_token_id only once no prefill is left; while positions
        # remain to be computed (a recomputed preemption, a moved request) it must prefill them
        # first, so it gets -1, never a token it could mistake for a start-decoding signal.
        last = -1
        if num_hit >= req.num_prefill_tokens and req.output_token_ids:
            last = req.output_token_ids[-1]
        tasks = self.tasks
        sampling = req.sampling
        if self._stored_hand_off:  # the prefill worker samples the first token only
            sampling = StorageHandOffs.placement_sampling(req)
        tasks.placements.append(
            Placement(
                handle=req.handle,
                slot=req.slot,
                req_id=req.req_id,
                block_ids=list(req.block_ids),
                num_cached_tokens=num_hit,
                num_prefill_tokens=req.num_prefill_tokens,
                num_output_tokens=req.num_output_tokens,
                last_token_id=last,
                sampling=sampling,
                lora_name=req.lora_name,
                mm_ranges=list(req.mm_ranges),
            )
        )
        if req.kv_target is not None and not self._stored_hand_off:
            dst, dst_handle, dst_blocks = req.kv_target
            tasks.kv_sends.append(KvSend(req.handle, dst, dst_handle, dst_blocks))

    def _host_hits(
        self, num_gpu_hits: int, host_hits: list[int], num_hit: int
    ) -> tuple[list[int], int]:
        """The host hits worth swapping in: those within num_hit (multimodal trimming), none
        when the step-cost model predicts copying them costs at least recomputing them.
        Returns them and how many were declined."""
        bs = self.block_size
        host_hits = host_hits[: max(0, num_hit // bs - num_gpu_hits)]
        n, prefix = len(host_hits) * bs, num_gpu_hits * bs
        cost = self.plan.cost
        a_tok, a_attn = cost.prefill_costs
        if cost.swap_block_ms * len(host_hits) >= a_tok * n + a_attn * n * (n + prefix):
            return [], len(host_hits)
        return host_hits, 0

    def _storage_hits(
        self, num_above: int, stored: list[str], num_hit: int, host_declined: bool
    ) -> tuple[list[str], int]:
        """The storage hits worth fetching: those within num_hit (multimodal trimming), none
        when the host hits before them were declined (the run would have a hole) or when the
        step-cost model predicts fetching them costs at least recomputing them. Returns them
        and how many were declined."""
        bs = self.block_size
        if host_declined:
            return [], len(stored)
        stored = stored[: max(0, num_hit // bs - num_above)]
        if self.config.role == Role.DECODE:  # a prompt handed off through the store: a
            return stored, 0  # decode instance fetches it (its prefill instance computed it)
        n, prefix = len(stored) * bs, num_above * bs
        cost = self.plan.cost
        a_tok, a_attn = cost.prefill_costs
        if cost.fetch_block_ms * len(stored) >= a_tok * n + a_attn * n * (n + prefix):
            return [], len(stored)
        return stored, 0

    def _reserve_floor(self, req: Request, budget: StepBudget) -> None:
        """Hold back the time of req's floor chunk before shorter prompts take the slack, so
        the floor exceeds the target only when the decodes leave less than it."""
        count, own_tokens, own_attn = self.plan.outstanding_of(req)
        if count >= PIPELINE_DEPTH or budget.slack_ms is None:
            return
        start = req.num_computed_tokens
        n = min(budget.floor, _prefill_left(req))
        cost = self.plan.chunk_extra_ms(start, n, own_tokens, own_attn)
        budget.floor_ms = max(0.0, min(cost, budget.slack_ms))
        budget.slack_ms -= budget.floor_ms

    def _slack_bound(self, budget: StepBudget) -> bool:
        """The time target limits this step's prefill (computed once per step)."""
        if budget.slack_ms is None:
            budget.slack_ms = self.plan.time_slack_ms(self.backlog.drain_claim_ms())
        return budget.slack_ms != float("inf")

    # ==== chunks ==============================================================================
    def _chunk_size(self, req: Request, start: int, num_prefill: int | None = None) -> int:
        """Tokens of req's prefill to run this step starting at `start`, or 0 if none fit."""
        sc, budget, plan = self.config.scheduler, self.budget, self.plan
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        remaining = total - start
        # A chunk no larger than req's own outstanding ones adds nothing to any worker step.
        _, own_tokens, own_attn = plan.outstanding_of(req)
        n = min(remaining, budget.tokens + own_tokens)
        if req.logprobs is not None and prefills_at_once(req):  # (no time cut: whole or none)
            return n if n == remaining else 0
        if sc.long_prefill_token_threshold:
            n = min(n, sc.long_prefill_token_threshold)
        if sc.disable_chunked_prefill and n < remaining:
            return 0
        if n > 0:
            self._slack_bound(budget)  # (sets budget.slack_ms once per call)
            assert budget.slack_ms is not None
            if req is budget.floor_for:
                budget.slack_ms += budget.floor_ms  # its floor was held back for it
                budget.floor_ms = 0.0
            n_time = plan.fit_time(start, n, own_tokens, own_attn, budget.slack_ms)
            if budget.floor and (budget.floor_for is None or budget.floor_for is req):
                # Never starve: the oldest progresses, by one floor chunk per worker step. The
                # floor is the step's, not this call's: when another request's chunk already
                # lands in the coming steps, prompts move there and this one waits for slack
                # (each arrival's schedule() used to send one more whole prompt into one step).
                if plan.outstanding_tokens() <= own_tokens:
                    n_time = max(n_time, min(n, budget.floor))
                budget.floor = 0
            n = n_time
        if req.mm_ranges:
            n = trim_chunk(req, start, n, budget.encoder, sc, self.enc, self.table.enc_needed)
        return n

    def _emit_chunk(self, req: Request, n: int) -> None:
        budget, plan = self.budget, self.plan
        start = req.num_computed_tokens
        _, own_tokens, own_attn = plan.outstanding_of(req)
        budget.tokens -= max(0, n - own_tokens)
        if budget.slack_ms is not None:
            budget.slack_ms -= plan.chunk_extra_ms(start, n, own_tokens, own_attn)
        plan.record_chunk(req, start, n)
        self.tasks.chunks.append(Chunk(req.handle, start, req.token_ids(start, start + n)))
        self.table.computed(req, start + n)
        if req.mm_ranges:
            enc_needed = self.table.enc_needed
            budget.encoder = charge_encoder(
                req, start, start + n, budget.encoder, self.enc, enc_needed
            )
        if req.num_computed_tokens >= req.num_prefill_tokens:
            self.table.prefill_sent(req, self.outbox.threshold)
        self.backlog.on_chunk(req, start, n)
