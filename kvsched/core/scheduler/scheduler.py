"""The scheduler of one instance: policy over a KVCacheManager (DESIGN section 3).

One call to `schedule()` plans the worker's next-but-one step and returns a `Tasks` message;
one call to `apply_report()` folds a worker's `StepReport` back in and returns what happened
(`Events`). Between them the worker decodes on its own, so a steady decode step costs the
scheduler almost nothing: it only appends reported tokens, and extends a request's blocks when
its free room falls to the prealloc threshold.

A step's token budget:

    max_num_batched_tokens = decoding x (1 + k)  +  continuing prefill chunks  +  new prefills
                             (worker-autonomous)    (admission order)            (queue order)
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvsched.core.config import EngineConfig, QueuePolicy, Role
from kvsched.core.errors import CapacityExceeded, InvalidRequest, ProtocolError, RequestNotFound
from kvsched.core.kv_cache_manager import KVCacheManager, _cdiv
from kvsched.core.protocol import (
    Chunk,
    Extension,
    FinishReason,
    KvSend,
    Placement,
    StepReport,
    Tasks,
)
from kvsched.core.queue import make_queue
from kvsched.core.request import FINISHED_STATUS, Request, RequestStatus
from kvsched.core.slots import RING, RING_SHIFT, SlotTable

_MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(slots=True)
class Events:
    """What changed since the last time events were taken. Requests carry their own state
    (tokens, status, timings); the lists say which ones to look at."""

    scheduled: list[Request] = field(default_factory=list)  # placed on a slot (again after preempt)
    first_token: list[Request] = field(default_factory=list)
    # New output tokens, in the order they were reported (a request's deltas are in order, each
    # token in exactly one delta): a report's plain decode rows as one columnar delta
    # (SlotTable.reqs as it was, slots, one token each), other rows as (request, None, tokens).
    tokens: list[TokenDelta] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # preemption decided
    requeued: list[Request] = field(default_factory=list)  # preemption acknowledged, waiting again
    finished: list[Request] = field(default_factory=list)
    handed_off: list[Request] = field(default_factory=list)  # prefill role: prompt done, KV sent
    out_of_blocks: list[Request] = field(default_factory=list)  # a worker slot paused for blocks

    @property
    def token_reqs(self) -> list[Request]:
        """The request of every delta (a request once per delta), in order."""
        out: list[Request] = []
        for a, slots, _ in self.tokens:
            if slots is None:
                out.append(a)
            else:
                out.extend(map(a.__getitem__, slots.tolist()))
        return out


@dataclass(slots=True)
class _Columns:
    """A validated report's columns as arrays: handles, their slots (handle & mask), tokens;
    `row_tok` is the token of each one-token row, `one` marks those rows (None: all are),
    `match` marks rows whose handle is on its slot now (None: not computed)."""

    h: np.ndarray
    s: np.ndarray
    toks: np.ndarray
    row_tok: np.ndarray | None = None
    one: np.ndarray | None = None
    match: np.ndarray | None = None
    all_match: bool = False  # every row's handle is on its slot (match not computed)
    fins: np.ndarray | None = None  # finish reasons; None: no row finished


# The most decode headroom (tokens) the observed round trip may ask for: within a slot's ring.
MAX_ADAPTIVE_HEADROOM = RING // 2

# Output tokens of one report: (SlotTable.reqs as it was, slots, the token of each slot) for its
# plain decode rows, (request, None, tokens) for a row taken one by one.
TokenDelta = tuple[Any, np.ndarray | None, Any]


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_preemption_skips: int = 0  # victims spared because they hit max_preemptions
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[FinishReason, int] = field(default_factory=dict)


class Scheduler:
    """Owns one instance's waiting queue, running set, slots and KV blocks.

    Public calls are synchronous and deterministic; `clock` gives timestamps only.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        instance_id: str = "",
        first_handle: int = 0,
    ) -> None:
        """`first_handle`: where handle numbers start. A scheduler that replaces another for
        the same instance (its workers reconnected) continues the old numbering, so a message
        still addressed to an old handle can never name a new request."""
        self.config = config = (config or EngineConfig()).validate()
        self.clock = clock
        self.instance_id = instance_id
        cc, sc = config.cache, config.scheduler
        self.block_size = cc.block_size
        self.kv = KVCacheManager(cc.block_size, cc.num_gpu_blocks, cc.enable_prefix_caching)
        self.waiting = make_queue(sc.policy)
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.running: dict[str, Request] = {}  # placed, in admission order (LIFO victims)
        self.prefilling: dict[str, Request] = {}  # running with prefill chunks still to send
        self.needs_blocks: dict[str, Request] = {}  # decoding, room at or below threshold
        self.reserved: dict[str, Request] = {}  # decode role: room held for pushed KV
        self.live: dict[int, Request] = {}  # handle -> placed or preempted-awaiting-ack
        self.num_decoding = 0
        self.next_handle = first_handle
        self.first_handle = first_handle
        self.free_slots = list(range(sc.max_num_seqs - 1, -1, -1))
        self.slots = SlotTable(sc.max_num_seqs)
        self.paused = False
        self.stats = SchedulerStats()
        self._seq = 0
        self._last_step = -1
        self._last_applied_seq = -1
        # Decode headroom follows the control plane's round trip: `_lag` is how many worker
        # steps pass between the report a Tasks message was decided on and the report showing
        # the worker applied it (fast attack, slow decay); `_threshold` is the room, in tokens,
        # at which a decoding request gets more blocks: prealloc_threshold, or what the worker
        # decodes in one round trip when that is more (a fast worker would otherwise pause its
        # slots waiting for extensions).
        self._lag = 0.0
        self._threshold = cc.prealloc_threshold
        self._sent: collections.deque[tuple[int, int]] = collections.deque()  # (seq, step seen)
        self._pending_preempts: list[int] = []
        self._pending_aborts: list[int] = []
        self._pending_placements: list[Placement] = []
        self._extended: list[Extension] = []  # made by report visits, for the next Tasks
        self._ones_bytes = b""  # int64 ones, as bytes (_check_report)
        self._zero_bytes = b""  # int64 zeros, as bytes (_check_report)
        self._pending_reset = False
        self._reserve = float(cc.reserve_blocks)
        self._relaxed = cc.reserve_blocks == 0
        self._spec_k = config.speculative.num_speculative_tokens
        self._enc_left = -1  # encoder tokens left this step; -1: unlimited
        # Blocks the admitted prompts still need to finish their prefill (admit_full_prompt).
        self._prefill_debt = 0
        self._prefill_role = config.role == Role.PREFILL
        self.events = Events()

    # ==== requests in and out =================================================================
    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises InvalidRequest (bad fields, duplicate id) or
        CapacityExceeded (the queue is at max_waiting); state is unchanged when it raises."""
        self._validate(req)
        if len(self.waiting) >= self.config.scheduler.max_waiting:
            raise CapacityExceeded(
                f"waiting queue is full ({self.config.scheduler.max_waiting} requests); "
                "retry later or raise scheduler.max_waiting"
            )
        req.status = RequestStatus.WAITING
        if req.arrival_time == 0.0:
            req.arrival_time = self.clock()
        self.requests[req.req_id] = req
        self.waiting.push(req)

    def _validate(self, req: Request) -> None:
        sc, sp = self.config.scheduler, req.sampling
        rid = req.req_id
        if not rid:
            raise InvalidRequest("request_id must not be empty")
        if rid in self.requests:
            raise InvalidRequest(f"request_id {rid!r} is already in use by a live request")
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequest(f"request {rid!r}: prompt_token_ids is empty")
        if sp.max_tokens < 1:
            raise InvalidRequest(f"request {rid!r}: max_tokens = {sp.max_tokens} must be >= 1")
        if sp.min_tokens < 0 or sp.min_tokens > sp.max_tokens:
            raise InvalidRequest(
                f"request {rid!r}: min_tokens = {sp.min_tokens} must be in [0, max_tokens]"
            )
        if n + sp.max_tokens > sc.max_model_len:
            raise InvalidRequest(
                f"request {rid!r}: prompt ({n} tokens) + max_tokens ({sp.max_tokens}) = "
                f"{n + sp.max_tokens} exceeds max_model_len {sc.max_model_len}"
            )
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) > _MAX_TOKEN_ID:
            raise InvalidRequest(f"request {rid!r}: token ids must be in [0, 2^31)")
        if req.priority < 0 and sc.policy == QueuePolicy.PRIORITY:
            raise InvalidRequest(f"request {rid!r}: priority = {req.priority} must be >= 0")
        need_blocks = -(-(n + 1) // self.block_size)
        if need_blocks > self.kv.pool.num_blocks:
            raise InvalidRequest(
                f"request {rid!r}: a prompt of {n} tokens needs {need_blocks} KV blocks but the "
                f"instance has {self.kv.pool.num_blocks} ({self.kv.pool.num_blocks * self.block_size}"
                " tokens): shorten the prompt"
            )
        if not math.isfinite(sp.temperature) or not math.isfinite(sp.top_p):
            raise InvalidRequest(f"request {rid!r}: temperature and top_p must be finite numbers")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k < 0:
            raise InvalidRequest(
                f"request {rid!r}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0"
            )
        prev_end = 0
        for r in req.mm_ranges:
            if r.offset < prev_end:
                raise InvalidRequest(
                    f"request {rid!r}: multimodal ranges must be sorted by offset and must not "
                    f"overlap (a range starts at {r.offset}, before {prev_end})"
                )
            prev_end = r.offset + r.length
            if r.offset < 0 or r.length < 1 or r.offset + r.length > n or not r.content_hash:
                raise InvalidRequest(
                    f"request {rid!r}: multimodal range (offset {r.offset}, length {r.length}) "
                    f"must lie inside the prompt (0..{n}) and carry a content hash"
                )
            if self._mm_budget_blocks(r.length):
                raise InvalidRequest(
                    f"request {rid!r}: a multimodal item of {r.length} tokens can never fit "
                    "the per-step token or encoder budget with chunked mm input disabled"
                )

    def _mm_budget_blocks(self, length: int) -> bool:
        sc = self.config.scheduler
        if not sc.disable_chunked_mm_input:
            return False
        enc = sc.max_num_encoder_tokens
        return length > sc.max_num_batched_tokens or bool(enc and length > enc)

    def abort(
        self, req_id: str, reason: FinishReason = FinishReason.ABORT, message: str = ""
    ) -> Request:
        """End a live request now. A waiting one just finishes; a placed one's blocks are freed
        and the worker is told in the next Tasks (before any task that reuses them). Raises
        RequestNotFound for an id that is not live."""
        req = self.requests.get(req_id)
        if req is None:
            raise RequestNotFound(f"no live request with id {req_id!r} (finished or never seen)")
        if req.status == RequestStatus.WAITING:
            self.waiting.discard(req)
        elif req.handle >= 0:
            self._pending_aborts.append(req.handle)
        self._finish(req, reason, message or "aborted")
        return req

    # ==== the step ============================================================================
    def schedule(self) -> Tasks:
        """Plan the next step: block extensions, continuing prefill chunks, new admissions.
        Cost O(requests touched), independent of the number waiting."""
        self._seq += 1
        tasks = Tasks(seq=self._seq)
        if not self.paused:
            self._enc_left = self.config.scheduler.max_num_encoder_tokens or -1
            budget = self.config.scheduler.max_num_batched_tokens - self.num_decoding * (
                1 + self._spec_k
            )
            preempted = self._extend_decoders(tasks)
            budget, preempted2 = self._continue_prefills(tasks, budget)
            if not (preempted or preempted2):
                budget = self._admit(tasks, budget)
                if self.running:
                    self._decay_reserve()
        # Preempts and aborts go first in the message: their blocks may be reused below.
        if (self._pending_preempts or self._pending_aborts) and (tasks.extensions or tasks.chunks):
            # A request extended or given a chunk earlier in this step may have been preempted
            # (priority preemption) or ended (a lone request out of room) later in it: drop its
            # tasks, their blocks may be reused.
            gone = {*self._pending_preempts, *self._pending_aborts}
            tasks.extensions = [e for e in tasks.extensions if e.handle not in gone]
            tasks.chunks = [c for c in tasks.chunks if c.handle not in gone]
        tasks.preempts, self._pending_preempts = self._pending_preempts, []
        tasks.aborts, self._pending_aborts = self._pending_aborts, []
        tasks.placements, self._pending_placements = (
            self._pending_placements + tasks.placements,
            [],
        )
        tasks.reset_prefix_cache, self._pending_reset = self._pending_reset, False
        tasks.report_step = max(self._last_step, 0)
        self.stats.num_steps += 1
        if not tasks.is_empty():
            self._sent.append((self._seq, self._last_step))
            if len(self._sent) > 4096:  # a worker that never reports applying anything
                self._sent.popleft()
        return tasks

    def _extend_decoders(self, tasks: Tasks) -> bool:
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
        preempted = False
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
                preempted = True
                if self._preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # it was the victim (and left needs_blocks)
            del needs[req.req_id]
            if new:
                tasks.extensions.append(Extension(req.handle, new))
            self._set_check_at(req)
        return preempted

    def _grow(self, req: Request) -> list[int] | None:
        """Append blocks to a decoding request's table: `prealloc_blocks` more (one more with
        speculative decoding) and room for two round trips of the worker, never past the last
        position it can write. Returns the new block ids ([] when it needs none), or None,
        changing nothing, when the pool has too few free blocks."""
        bs, ids, spec_k = self.block_size, req.block_ids, self._spec_k
        p = len(req.prompt_token_ids)
        limit = _cdiv(p + req.sampling.max_tokens - 1, bs)  # blocks it can ever need
        want = max(
            len(ids) + self.config.cache.prealloc_blocks + (1 if spec_k else 0),
            _cdiv(p + len(req.output_token_ids) + 2 * self._threshold + spec_k + 1, bs),
        )
        need = min(want, limit) - len(ids)
        if need <= 0:
            return []
        new = self.kv.pool.allocate(need)
        if new is not None:
            ids.extend(new)
        return new

    def _continue_prefills(self, tasks: Tasks, budget: int) -> tuple[int, bool]:
        preempted = False
        for req in list(self.prefilling.values()):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            n = self._chunk_size(req, req.num_computed_tokens, budget)
            if n <= 0:
                continue
            end = req.num_computed_tokens + n
            while (new := self.kv.allocate_slots(req, self._alloc_target(req, end))) is None:
                preempted = True
                if self._preempt_victim(for_req=req) is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            assert new is not None
            if new:
                tasks.extensions.append(Extension(req.handle, new))
                self._prefill_debt -= len(new)
            budget -= n
            self._emit_chunk(tasks, req, n)
        return budget, preempted

    def _admit(self, tasks: Tasks, budget: int) -> int:
        while budget > 0 and self.free_slots and (req := self.waiting.peek()) is not None:
            if self.config.role == Role.DECODE and not req.output_token_ids:
                break  # a decode instance takes new prompts only through add_prefilled
            hits = self.kv.find_cached_prefix(req)
            num_hit = self._trim_hits_for_mm(req, len(hits) * self.block_size)
            hits = hits[: num_hit // self.block_size]
            n = self._chunk_size(req, num_hit, budget, num_prefill=req.num_tokens)
            if n <= 0:
                break
            target = self._alloc_target(req, num_hit + n, num_prefill=req.num_tokens)
            need = self.kv.num_blocks_to_allocate(req, target, hits)
            if self.config.scheduler.admit_full_prompt:
                # Admit only what can finish its prefill: the whole prompt must fit beside the
                # rest of the prompts already admitted, or its later chunks preempt decoders.
                full = self._alloc_target(req, req.num_tokens, num_prefill=req.num_tokens)
                need = self.kv.num_blocks_to_allocate(req, full, hits) + self._prefill_debt
            reserve = self.reserve_blocks_per_running * len(self.running)
            if need + reserve > self.kv.num_free_blocks:
                if not self._priority_preempt_for(req):
                    break
                continue
            self.waiting.pop()
            new = self.kv.allocate_slots(req, target, hits)
            assert new is not None
            self._prefill_debt += self._full_blocks(req, req.num_tokens) - len(req.block_ids)
            self._place(tasks, req, num_hit)
            budget -= n
            self._emit_chunk(tasks, req, n)
        return budget

    # ==== pieces of a step ====================================================================
    def _chunk_size(
        self, req: Request, start: int, budget: int, num_prefill: int | None = None
    ) -> int:
        """Tokens of req's prefill to run this step starting at `start`, or 0 if none fit."""
        sc = self.config.scheduler
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        remaining = total - start
        n = min(remaining, budget)
        if sc.long_prefill_token_threshold:
            n = min(n, sc.long_prefill_token_threshold)
        if sc.disable_chunked_prefill and n < remaining:
            return 0
        if req.mm_ranges:
            n = self._trim_chunk_for_mm(req, start, n)
        return n

    def _trim_chunk_for_mm(self, req: Request, start: int, n: int) -> int:
        """Never end a chunk inside an image range (disable_chunked_mm_input), and keep the
        step's multimodal tokens within the encoder budget: roll back to the range start."""
        sc = self.config.scheduler
        end, enc_left = start + n, self._enc_left
        for r in req.mm_ranges:
            r_end = r.offset + r.length
            if r_end <= start or r.offset >= end:
                continue
            if sc.disable_chunked_mm_input and r.offset < end < r_end:
                end = max(r.offset, start)
                break
            used = min(r_end, end) - max(r.offset, start)
            if enc_left >= 0 and used > enc_left:
                end = max(r.offset, start)
                break
            enc_left -= used if enc_left >= 0 else 0
        return end - start

    def _use_encoder_budget(self, req: Request, start: int, end: int) -> None:
        if self._enc_left < 0:
            return
        for r in req.mm_ranges:
            self._enc_left -= max(0, min(r.offset + r.length, end) - max(r.offset, start))

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

    def _alloc_target(self, req: Request, end: int, num_prefill: int | None = None) -> int:
        """Positions the table must cover once a chunk ending at `end` is scheduled: the chunk,
        plus decode headroom when it is the prompt's last chunk."""
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        if end < total:
            return end
        cc = self.config.cache
        # First decode writes position `total`; speculative drafts write k more. Never beyond
        # the last position the request can ever write (its last token's KV is never needed).
        # (The configured threshold, not the adaptive one: the prefill debt counts on this
        # target staying fixed while the prompt is in; the first decode visit tops it up.)
        room = end + 1 + self._spec_k + cc.prealloc_threshold
        room = max(end, min(room, self._kv_limit(req)))
        return _cdiv(room, self.block_size) * self.block_size

    @staticmethod
    def _kv_limit(req: Request) -> int:
        """KV positions req can ever need: prompt + max_tokens - 1."""
        return len(req.prompt_token_ids) + req.sampling.max_tokens - 1

    def _full_blocks(self, req: Request, num_prefill: int | None = None) -> int:
        """Blocks req's table holds once its whole prefill (and first decode room) is in."""
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        return _cdiv(self._alloc_target(req, total, num_prefill=total), self.block_size)

    def _place(self, tasks: Tasks, req: Request, num_hit: int) -> None:
        """Give req a slot and a fresh handle; the worker learns it from a Placement."""
        now = self.clock()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            req.first_scheduled_time = now
            self.kv.record_lookup(req.num_tokens, num_hit)
            self.stats.num_prompt_tokens += len(req.prompt_token_ids)
        req.status = RequestStatus.RUNNING
        req.slot = self.free_slots.pop()
        self._issue_handle(req)
        req.num_prefill_tokens = req.num_tokens
        req.num_computed_tokens = req.num_reported_tokens = num_hit
        self.live[req.handle] = req
        self.running[req.req_id] = req
        self.prefilling[req.req_id] = req
        last = req.output_token_ids[-1] if req.output_token_ids else -1
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
                sampling=req.sampling,
                lora_name=req.lora_name,
            )
        )
        if req.kv_target is not None:
            dst, dst_handle, dst_blocks = req.kv_target
            tasks.kv_sends.append(KvSend(req.handle, dst, dst_handle, dst_blocks))
        self.events.scheduled.append(req)

    def _issue_handle(self, req: Request) -> None:
        """A fresh handle for req's slot (handle & mask == slot), and the slot table row."""
        req.handle = self.slots.handle_for(req.slot, self.next_handle)
        self.next_handle = req.handle + 1
        self.slots.bind(req)

    def _emit_chunk(self, tasks: Tasks, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        tasks.chunks.append(Chunk(req.handle, start, req.token_ids(start, start + n)))
        req.num_computed_tokens = start + n
        if req.mm_ranges:
            self._use_encoder_budget(req, start, start + n)
        if req.num_computed_tokens >= req.num_prefill_tokens:
            del self.prefilling[req.req_id]
            self.num_decoding += 1
            self._set_check_at(req)

    def _set_check_at(self, req: Request) -> None:
        """The output count at which this decoding request next needs the scheduler: its room
        falls to the prealloc threshold, it reaches max_tokens, or its next block fills."""
        if self._prefill_role:
            self.slots.set_check(req, 0)  # its first token is a hand-off
            return
        p = len(req.prompt_token_ids)
        capacity = len(req.block_ids) * self.block_size
        finish_at = p + req.sampling.max_tokens
        if capacity >= finish_at - 1:  # it already holds every position it can write
            check_at = finish_at
        else:
            check_at = min(capacity - self._threshold - self._spec_k, finish_at)
        # Full output blocks are registered in the prefix cache on these visits and when the
        # request leaves its slot, not one visit per block (see _release).
        # No output yet: the first token itself needs the slow path (first-token event).
        self.slots.set_check(req, check_at - p if req.output_token_ids else 1)

    # ==== preemption ==========================================================================
    def _preempt_victim(self, for_req: Request) -> Request | None:
        """Preempt the request the policy would give up first and return it. LIFO (priority
        policy: lowest priority, then latest arrival); requests at max_preemptions are spared
        unless nothing else is left. Returns for_req itself when it is the only choice."""
        victim = self._choose_victim(exclude=for_req)
        if victim is None:
            victim = for_req
        self._preempt(victim)
        return victim

    def _choose_victim(self, exclude: Request | None) -> Request | None:
        sc = self.config.scheduler
        cap = sc.max_preemptions
        if sc.policy == QueuePolicy.PRIORITY:
            cands = sorted(
                (r for r in self.running.values() if r is not exclude),
                key=lambda r: (r.priority, r.arrival_time),
                reverse=True,
            )
        else:
            cands = [r for r in reversed(self.running.values()) if r is not exclude]
        for r in cands:
            if cap and r.num_preemptions >= cap:
                self.stats.num_preemption_skips += 1
                continue
            return r
        return None

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and slot now; the preempt goes out in the next Tasks, ahead of any
        task reusing them. It re-enters the queue when the worker acknowledges."""
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._pending_preempts.append(req.handle)
        self._reserve = float(self.config.cache.reserve_blocks)
        self._relaxed = self.config.cache.reserve_blocks == 0
        self.events.preempted.append(req)

    def _priority_preempt_for(self, req: Request) -> bool:
        """Priority policy with priority_preemption: make room for a waiting request by
        preempting a strictly lower-priority running one. True if one was preempted."""
        sc = self.config.scheduler
        if not (sc.policy == QueuePolicy.PRIORITY and sc.priority_preemption):
            return False
        victim = self._choose_victim(exclude=None)
        if victim is None or victim.priority <= req.priority:
            return False
        self._preempt(victim)
        return True

    def _decay_reserve(self) -> None:
        cc = self.config.cache
        if self._relaxed:
            return
        self._reserve -= cc.reserve_decay
        if max(int(self._reserve), cc.reserve_min, 0) == 0:
            self._relaxed = True

    @property
    def reserve_blocks_per_running(self) -> int:
        """The admission reserve in force now (0 once relaxed)."""
        if self._relaxed:
            return 0
        return max(int(self._reserve), self.config.cache.reserve_min, 0)

    # ==== one exit path =======================================================================
    def _release(self, req: Request) -> None:
        """Return req's blocks (tail first) and slot, and take it out of the running sets.
        Finish, abort, preempt and hand-off all go through here."""
        rid = req.req_id
        if self.running.pop(rid, None) is not None:
            if self.prefilling.pop(rid, None) is None:
                self.num_decoding -= 1
            else:
                self._prefill_debt -= self._full_blocks(req) - len(req.block_ids)
            self.needs_blocks.pop(rid, None)
        self.reserved.pop(rid, None)
        if req.block_ids:
            self.kv.cache_reported(req)  # written blocks not registered on a visit yet
            self.kv.free(req)
        if req.slot >= 0:
            self.slots.unbind(req)
            self.free_slots.append(req.slot)
            req.slot = -1

    def _finish(self, req: Request, reason: FinishReason, message: str = "") -> None:
        self._release(req)
        self.live.pop(req.handle, None)
        self.requests.pop(req.req_id, None)
        req.status = FINISHED_STATUS[reason]
        req.finish_reason = reason
        req.finish_message = message
        req.finished_time = self.clock()
        fin = self.stats.num_finished
        fin[reason] = fin.get(reason, 0) + 1
        self.events.finished.append(req)

    # ==== reports =============================================================================
    def apply_report(self, report: StepReport) -> Events:
        """Fold a worker's step report in: append tokens, register written blocks in the prefix
        cache, finish what the worker stopped, re-queue acknowledged preemptions. Raises
        ProtocolError (state unchanged) for reports that break the protocol. Returns the events
        since the last call (including those of schedule() and abort())."""
        cols = self._check_report(report)
        if report.applied_seq > self._last_applied_seq and self._sent:
            self._observe_lag(report)
        self._last_step, self._last_applied_seq = report.step, report.applied_seq
        live, events = self.live, self.events
        get = live.get
        # Failures first: a prefill worker reports the prompt's first token in the same report
        # as its failed KV push, and that row must not hand the request off.
        if len(report.failed):
            for h in list(report.failed):
                req = live.get(int(h))
                if req is not None:
                    self._finish(req, FinishReason.ERROR, "worker failed the request (KV transfer)")
            cols.match, cols.all_match = None, False  # slots were freed: compare again
        # The hot path: plain decode rows (one token, handle still on its slot) are a handful
        # of vectorized operations over the slot table; each row's request is looked at only
        # when its output count reaches its precomputed check (a first token, blocks to extend,
        # max_tokens). Every other row (a prefill chunk, several tokens, a late row about a
        # request no longer on its slot) is taken one by one.
        n_gen = len(cols.toks)
        slow: list[Request] = []
        if len(cols.h):
            # A merged report (the worker stepped faster than the stream drained) names a
            # handle once per step: apply it in rounds, each handle at most once per round.
            rounds = self.slots.rounds(cols.s, cols.h)
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
        self.stats.num_generation_tokens += n_gen
        for h in list(report.paused):
            req = live.get(int(h))
            if req is not None and req.status == RequestStatus.RUNNING and req.is_prefill_done:
                events.out_of_blocks.append(req)
                # Its table already reaches past what the worker wrote: an extension is on its
                # way (queued or in flight) and resumes the slot; another would be waste.
                if len(req.block_ids) * self.block_size <= req.num_reported_tokens:
                    self.needs_blocks[req.req_id] = req
        for h in list(report.acked):
            req = live.get(int(h))
            if req is not None and req.status == RequestStatus.PREEMPTED:
                self._requeue(req)
        return self.take_events()

    def _observe_lag(self, report: StepReport) -> None:
        """The worker applied Tasks up to report.applied_seq: how many of its steps passed
        since the report that Tasks message was decided on; adapt the decode headroom."""
        sent, seen = self._sent, -1
        while sent and sent[0][0] <= report.applied_seq:
            seen = sent.popleft()[1]
        if seen < 0:
            return
        lag = float(report.step - seen)
        self._lag = lag if lag > self._lag else 0.99 * self._lag + 0.01 * lag
        cc = self.config.cache
        want = math.ceil(self._lag * (1 + self._spec_k))
        self._threshold = max(cc.prealloc_threshold, min(want, MAX_ADAPTIVE_HEADROOM))

    def _apply_round(
        self,
        report: StepReport,
        cols: _Columns,
        idx: np.ndarray | None,
        slow: list[Request],
        last: bool = True,
    ) -> int:
        """Apply report rows `idx` (None: all), no handle twice. Plain decode rows whose handle
        is still on its slot are vectorized; the rest go one by one. `last`: no round of this
        report follows. Returns the reported tokens not kept."""
        slots = self.slots
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
            self.events.tokens.append((reqs, vs, vt))
            due = np.flatnonzero(pos >= slots.check[vs])
            if len(due):
                due_slots = vs[due]
                first = self.events.first_token
                now = -1.0
                for i in due_slots.tolist():
                    req = reqs[i]
                    assert req is not None
                    if not last:
                        slots.sync(req)  # its ring is free again for the later rounds
                    slow.append(req)
                    if req.first_token_time < 0:
                        if now < 0:
                            now = self.clock()
                        req.first_token_time = now
                        first.append(req)
                if not last:
                    # Later rounds of a merged report find it due again only if its ring
                    # fills; the visit after the last round sets its real next check.
                    slots.check[due_slots] = pos[due] + RING
        return self._apply_rows(report, py_rows, slow) if py_rows else 0

    def _apply_rows(self, report: StepReport, rows: list[int], slow: list[Request]) -> int:
        """Report rows taken one by one, in order. Returns the reported tokens not kept (rows
        about requests gone, tokens past max_tokens)."""
        get, first, deltas = self.live.get, self.events.first_token, self.events.tokens
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
            req.num_reported_tokens = int(comps[i])  # (moves its ring tokens to it first)
            out = req._out
            if n_new:
                if not out:
                    req.first_token_time = self.clock()
                    first.append(req)
                room = req.sampling.max_tokens - len(out)
                kept = min(n_new, max(room, 0))
                start = ends[i] - n_new
                new = [int(t) for t in toks[start : start + kept]]
                out.extend(new)
                dropped += n_new - kept
                if req._rows is not None:
                    req._rows.rebase(req)
                if new:
                    deltas.append((req, None, new))
                if n_new == 1 and len(out) < req.check_out:
                    continue
            slow.append(req)  # several tokens, or a prefill chunk ran: blocks to cache
        return dropped

    def _after_report(self, req: Request, finish_reason: int) -> None:
        """The slow path of a report row: caching, hand-off, finish, block extension."""
        if req.status == RequestStatus.PREEMPTED:
            # It finished before the worker saw the preempt: keep that; the ack is ignored.
            if finish_reason:
                self._finish(req, FinishReason(finish_reason))
            elif req.num_output_tokens >= req.sampling.max_tokens:
                self._finish(req, FinishReason.LENGTH)
            return
        if req._rows is not None:
            req._rows.sync(req)  # below, req._out and req._reported are current
        capacity = len(req.block_ids) * self.block_size
        if req._reported > capacity:
            raise ProtocolError(
                f"handle {req.handle}: reported {req._reported} KV positions but its "
                f"table holds {capacity}"
            )
        self.kv.cache_reported(req)
        if finish_reason:
            self._finish(req, FinishReason(finish_reason))
            return
        n_out = len(req._out)
        if n_out >= req.sampling.max_tokens:
            self._finish(req, FinishReason.LENGTH)
            return
        if n_out and self._prefill_role:
            self.live.pop(req.handle, None)
            self._release(req)
            self.requests.pop(req.req_id, None)
            self.events.handed_off.append(req)
            return
        if self._prefill_role:
            self._set_check_at(req)  # its first token is a hand-off: it never decodes here
            return
        if req.num_computed_tokens >= req.num_prefill_tokens:  # prefill done: decoding
            if capacity - len(req.prompt_token_ids) - n_out <= self._threshold + self._spec_k:
                # Room is low: extend it now (sent with the next Tasks) if the pool has the
                # blocks; else the next schedule() makes room (or preempts), and until then it
                # needs a visit only for its first token, at max_tokens, or when its ring fills.
                new = None if self.paused else self._grow(req)
                if new is None:
                    self.needs_blocks[req.req_id] = req
                    self.slots.set_check(req, req.sampling.max_tokens if n_out else 1)
                    return
                self.needs_blocks.pop(req.req_id, None)  # (an earlier visit found it dry)
                if new:
                    self._extended.append(Extension(req.handle, new))
            self._set_check_at(req)

    def _requeue(self, req: Request) -> None:
        self.live.pop(req.handle, None)
        req.handle = -1
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_reported_tokens = 0
        self.waiting.push_front(req)
        self.events.requeued.append(req)

    def _check_report(self, report: StepReport) -> _Columns:
        """Validate a report before anything changes; returns its columns as arrays."""
        if report.step <= self._last_step:
            raise ProtocolError(
                f"report for step {report.step} after step {self._last_step}: steps must increase"
            )
        if not self._last_applied_seq <= report.applied_seq <= self._seq:
            raise ProtocolError(
                f"report says it applied tasks {report.applied_seq}, but tasks "
                f"{self._last_applied_seq + 1}..{self._seq} are the only ones it could have"
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
        cols = _Columns(h, h & self.slots.mask, toks)
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
            on_slot = self.slots.handle[cols.s]
            if on_slot.tobytes() == h.tobytes():
                # An empty slot holds -1: a row naming -1 (or any handle below the first one
                # issued) would match it.
                if int(h.min()) < self.first_handle:
                    self._check_handles(h)  # raises
                cols.all_match = True
            else:
                cols.match = match = on_slot == h
                self._check_handles(h[~match])
        elif len(toks):
            raise ProtocolError("report token_ids length != sum(num_new_tokens)")
        for col in (report.acked, report.paused, report.failed):
            if len(col):
                self._check_handles(col)
        cols.fins = fin
        return cols

    def _check_handles(self, handles: Any) -> None:
        try:
            handles = np.asarray(handles, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise ProtocolError("report names a handle that is not a 64-bit integer") from None
        if len(handles) and (
            int(handles.min()) < self.first_handle or int(handles.max()) >= self.next_handle
        ):
            raise ProtocolError(
                "report names handle(s) never issued "
                f"(issued so far: {self.first_handle}..{self.next_handle - 1})"
            )

    def take_events(self) -> Events:
        ev, self.events = self.events, Events()
        return ev

    # ==== pause, resume, cache ================================================================
    def pause(self) -> list[Request]:
        """Preempt everything running and hold admissions (around weight updates)."""
        self.paused = True
        victims = list(reversed(self.running.values()))
        for req in victims:
            self._preempt(req)
        return victims

    def resume(self) -> None:
        self.paused = False

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; the worker is told in the next Tasks. Returns the
        number of hashes dropped."""
        n = self.kv.pool.reset_cache()
        for req in self.running.values():
            req.num_cached_blocks = len(req.block_ids)  # do not re-register old content
        self._pending_reset = True
        return n

    # ==== prefill / decode disaggregation =====================================================
    def preallocate(self, src: Request) -> tuple[int, list[int]] | None:
        """Decode role: hold a slot and blocks for a request another instance will prefill and
        push here. Returns (handle, block ids) for the prefill worker's KvSend, or None when
        there is no room now (nothing changes). The request is tracked here as `src.req_id`."""
        if not self.free_slots or src.req_id in self.requests:
            return None
        req = Request(
            src.req_id,
            list(src.prompt_token_ids),
            src.sampling,
            src.priority,
            src.arrival_time,
            src.lora_name,
            src.cache_salt,
            list(src.mm_ranges),
        )
        req.num_prefill_tokens = req.num_tokens
        target = self._alloc_target(req, req.num_tokens)
        if self.kv.allocate_slots(req, target) is None:
            return None
        req.status = RequestStatus.RUNNING
        req.slot = self.free_slots.pop()
        self._issue_handle(req)
        self.live[req.handle] = req
        self.requests[req.req_id] = req
        self.reserved[req.req_id] = req
        self._pending_placements.append(
            Placement(
                req.handle,
                req.slot,
                req.req_id,
                list(req.block_ids),
                0,
                req.num_prefill_tokens,
                0,
                -1,
                req.sampling,
                req.lora_name,
            )
        )
        return req.handle, list(req.block_ids)

    def add_prefilled(
        self, req_id: str, output_token_ids: list[int], num_cached_tokens: int
    ) -> Request:
        """Decode role: the KV of a preallocated request has arrived with its first token(s).
        Re-place it under a new handle on the same blocks; the worker decodes at once."""
        req = self.reserved.pop(req_id, None)
        if req is None:
            raise RequestNotFound(
                f"no preallocated request {req_id!r} on instance {self.instance_id!r}"
            )
        self._pending_aborts.append(req.handle)
        self.live.pop(req.handle, None)
        req.output_token_ids = list(output_token_ids)
        req.num_cached_tokens = num_cached_tokens
        req.first_scheduled_time = self.clock()
        # The pushed KV covers the prompt; decoding starts from the last output token, whose
        # KV is not written yet: prefill is done at num_tokens - 1.
        req.num_prefill_tokens = req.num_tokens - 1
        req.num_computed_tokens = req.num_reported_tokens = req.num_prefill_tokens
        self._issue_handle(req)
        self.live[req.handle] = req
        self.running[req.req_id] = req
        self.num_decoding += 1
        self.kv.cache_reported(req)
        self._pending_placements.append(
            Placement(
                req.handle,
                req.slot,
                req.req_id,
                list(req.block_ids),
                req.num_prefill_tokens,
                req.num_prefill_tokens,
                req.num_output_tokens,
                req.output_token_ids[-1],
                req.sampling,
                req.lora_name,
            )
        )
        self._set_check_at(req)
        if len(req.block_ids) * self.block_size - req.num_tokens <= self._threshold + self._spec_k:
            self.needs_blocks[req.req_id] = req
        self.events.scheduled.append(req)
        return req

    # ==== introspection =======================================================================
    @property
    def decode_headroom(self) -> int:
        """Room (tokens) at which a decoding request gets more blocks now (see `_lag`)."""
        return self._threshold

    @property
    def last_report_step(self) -> int:
        return self._last_step

    @property
    def last_tasks_seq(self) -> int:
        return self._seq

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def prefix_hit_tokens(self, req: Request) -> int:
        """Tokens of req's prompt this instance holds cached now (for routing); no side effects."""
        if not self.kv.enable_caching:
            return 0
        self.kv.ensure_hashes(req, (req.num_tokens - 1) // self.block_size)
        lookup = self.kv.pool.cached.get
        n = 0
        for h in req.block_hashes:
            if lookup(h) is None:
                break
            n += 1
        return n * self.block_size

    def check_integrity(self) -> None:
        """Assert every invariant of DESIGN section 3 (O(everything): tests only)."""
        owners: dict[int, int] = {}
        placed = list(self.running.values()) + [
            r for r in self.reserved.values() if r.req_id not in self.running
        ]
        for req in placed:
            assert req.status == RequestStatus.RUNNING, f"{req.req_id}: placed but {req.status!r}"
            assert len(set(req.block_ids)) == len(req.block_ids), f"{req.req_id}: block twice"
            for b in req.block_ids:
                owners[b] = owners.get(b, 0) + 1
            assert self.live.get(req.handle) is req, f"{req.req_id}: handle not live"
            assert req.slot >= 0
        self.kv.pool.check_integrity(owners)
        for req in placed:  # a cached block under a request holds that request's tokens
            for b, h in zip(req.block_ids, req.block_hashes, strict=False):
                got = self.kv.pool.block_hash[b]
                assert got is None or got == h, f"{req.req_id}: block {b} holds other tokens"
        # A block in two tables must hold the same tokens in both: the same chained hash at
        # the same index (it may have lost its cache entry to reset_prefix_cache since).
        content: dict[int, bytes | None] = {}
        for req in placed:
            for i, b in enumerate(req.block_ids):
                if owners[b] > 1:
                    hb = req.block_hashes[i] if i < len(req.block_hashes) else None
                    assert hb is not None, f"block {b} shared but {req.req_id} has no hash for it"
                    assert content.setdefault(b, hb) == hb, f"block {b} shared with other tokens"
        slots = [r.slot for r in placed]
        assert len(set(slots)) == len(slots), "two requests on one slot"
        table = self.slots
        for req in placed:
            s = req.slot
            assert table.reqs[s] is req and req._rows is table, f"{req.req_id}: slot row unbound"
            assert int(table.handle[s]) == req.handle and req.handle & table.mask == s
            lag = int(table.n_out[s]) - len(req._out)
            assert 0 <= lag <= RING, f"{req.req_id}: {lag} output tokens in the ring"
            assert int(table.check[s]) == req.check_out, f"{req.req_id}: slot check drifted"
        bound = {i for i, r in enumerate(table.reqs) if r is not None}
        assert bound == set(slots), "slot table rows != placed requests"
        assert all(int(table.handle[i]) == -1 for i in range(table.size) if i not in bound)
        assert len(slots) + len(self.free_slots) == self.config.scheduler.max_num_seqs
        assert set(slots).isdisjoint(self.free_slots), "a slot both used and free"
        waiting = list(self.waiting)
        assert len(waiting) == len(self.waiting), "queue count drifted"
        awaiting = [r for r in self.live.values() if r.status == RequestStatus.PREEMPTED]
        for r in awaiting:
            assert not r.block_ids and r.slot < 0, f"{r.req_id}: preempted but holds resources"
        groups = [
            set(r.req_id for r in waiting),
            set(self.running),
            set(r.req_id for r in awaiting),
        ]
        assert sum(map(len, groups)) == len(set().union(*groups)), "a request in two states"
        live_ids = set().union(*groups) | set(self.reserved)
        assert live_ids == set(self.requests), "live set != waiting + running + awaiting-ack"
        assert self.num_decoding == sum(1 for r in self.running.values() if r.is_prefill_done)
        debt = sum(self._full_blocks(r) - len(r.block_ids) for r in self.prefilling.values())
        assert self._prefill_debt == debt, f"prefill debt {self._prefill_debt} != {debt}"
        assert set(self.prefilling) == {
            r.req_id for r in self.running.values() if not r.is_prefill_done
        }
