"""The placed requests of one instance: who is on which slot under which handle, with which
blocks, and the one way out (`_release`, used by finish, abort, preempt and hand-off).

`Placements` is the base of the scheduler's parts (preemption, admission, reports, roles): it
holds the state they share, and the decisions that follow from a placement alone, a decoding
request's room (`_grow`, `_set_check_at`) and the decode headroom it is measured against, which
follows the control plane's round trip (`_observe_lag`). It also keeps what the next Tasks
message must carry (the `_pending_*` lists, `_extended`). Imported only by the modules of this
package; it imports none of them but `events`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from kvsched.core.config import EngineConfig, Role
from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager, _cdiv
from kvsched.core.protocol import Extension, FinishReason, KvSend, Placement, StepReport, Tasks
from kvsched.core.queue import make_queue
from kvsched.core.request import FINISHED_STATUS, Request, RequestStatus
from kvsched.core.scheduler.events import Events, SchedulerStats
from kvsched.core.slots import RING, SlotTable

# The most decode headroom (tokens) the observed round trip may ask for: within a slot's ring.
MAX_ADAPTIVE_HEADROOM = RING // 2


class Placements:
    """Owns one instance's waiting queue, live requests, running sets, slots and KV blocks."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        instance_id: str = "",
        first_handle: int = 0,
    ) -> None:
        self.config = config = (config or EngineConfig()).validate()
        self.clock = clock
        self.instance_id = instance_id
        cc, sc = config.cache, config.scheduler
        self.block_size = cc.block_size
        self.kv = KVCacheManager(
            cc.block_size,
            cc.num_gpu_blocks,
            cc.enable_prefix_caching,
            cc.num_host_blocks,
            cc.host_write_policy,
            cc.host_write_hits,
        )
        # The worker's multimodal encoder outputs (None: cache off).
        self.enc = EncoderCache(cc.encoder_cache_size) if cc.encoder_cache_size else None
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
        self.events = Events()
        self._seq = 0  # the last Tasks message's seq (only messages sent get one)
        self._answered = -1  # the report step the last message sent answered (report_step)
        # Decode headroom follows the control plane's round trip: `_lag` is how many worker
        # steps pass between the report a Tasks message was decided on and the report showing
        # the worker applied it (fast attack, slow decay); `_threshold` is the room, in tokens,
        # at which a decoding request gets more blocks: prealloc_threshold, or what the worker
        # decodes in one round trip when that is more (a fast worker would otherwise pause its
        # slots waiting for extensions).
        self._lag = 0.0
        self._threshold = cc.prealloc_threshold
        self._sent: collections.deque[tuple[int, int]] = collections.deque()  # (seq, step seen)
        # What the next Tasks message carries besides the step's own tasks.
        self._pending_preempts: list[int] = []
        self._pending_aborts: list[int] = []
        self._pending_placements: list[Placement] = []
        self._extended: list[Extension] = []  # made by report visits
        self._pending_reset = False
        self._spec_k = config.speculative.num_speculative_tokens
        # Blocks the admitted prompts still need to finish their prefill (admit_full_prompt).
        self._prefill_debt = 0
        self._prefill_role = config.role == Role.PREFILL

    def take_events(self) -> Events:
        ev, self.events = self.events, Events()
        return ev

    @property
    def decode_headroom(self) -> int:
        """Room (tokens) at which a decoding request gets more blocks now (see `_lag`)."""
        return self._threshold

    # ==== in ==================================================================================
    def _place(self, tasks: Tasks, req: Request, num_hit: int, num_swapped: int = 0) -> None:
        """Give req a slot and a fresh handle; the worker learns it from a Placement.
        num_swapped: tokens of num_hit that swap-ins bring from the host tier (their blocks
        are registered only once a report shows them: num_reported_tokens stops before)."""
        now = self.clock()
        if req.num_cached_tokens < 0:  # its first placement on this instance
            req.num_cached_tokens = num_hit
            if req.first_scheduled_time < 0:  # (a request moved off a lost instance keeps it)
                req.first_scheduled_time = now
            self.kv.record_lookup(req.num_tokens, num_hit, num_swapped)
            self.stats.num_prompt_tokens += len(req.prompt_token_ids)
            if num_swapped:
                req.num_host_cached_tokens = num_swapped
                self.events.host_hits.append(req)
        req.status = RequestStatus.RUNNING
        req.slot = self.free_slots.pop()
        self._issue_handle(req)
        req.num_prefill_tokens = req.num_tokens
        req.num_computed_tokens = num_hit
        req.num_reported_tokens = num_hit - num_swapped
        self.live[req.handle] = req
        self.running[req.req_id] = req
        self.prefilling[req.req_id] = req
        # The worker decodes from last_token_id only once no prefill is left; while positions
        # remain to be computed (a recomputed preemption, a moved request) it must prefill them
        # first, so it gets -1, never a token it could mistake for a start-decoding signal.
        last = -1
        if num_hit >= req.num_prefill_tokens and req.output_token_ids:
            last = req.output_token_ids[-1]
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
                mm_ranges=list(req.mm_ranges),
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

    # ==== room ================================================================================
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

    def _enc_needed(self, req: Request, handle: int, content_hash: str) -> bool:
        """req, placed under `handle`, may still run a chunk that reads the item's encoder
        output: that placement is live and the worker has not reported its KV past the item.
        (A preempt or abort in the same message is applied before its encoder drops.)"""
        if req.handle != handle or req.status != RequestStatus.RUNNING:
            return False
        if self.live.get(handle) is not req:
            return False
        done = req.num_reported_tokens
        return any(
            r.content_hash == content_hash and done < r.offset + r.length for r in req.mm_ranges
        )

    # ==== out: the one exit path ==============================================================
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

    def _requeue(self, req: Request) -> None:
        """A preempted request the worker acknowledged: waiting again, at the queue's front."""
        self.live.pop(req.handle, None)
        req.handle = -1
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_reported_tokens = 0
        self.waiting.push_front(req)
        self.events.requeued.append(req)
