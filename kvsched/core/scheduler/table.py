"""The placement table of one instance: which live request is on which slot under which handle,
with which blocks, and in which running set. The only writer of the slots, the handles, the live
and running/prefilling/decoding sets, the blocks a decoding request still needs, and the prefill
debt; the others ask it (`place`, `release`, `remove`, `grow`, ...) and read its fields.

`release` is the one way out of a slot (finish, abort, preempt, hand-off): it returns what it
freed (`Freed`), and its caller updates what else depends on that (the backlog, the tenants:
`exits.Exits`). A request's room (`grow`, `set_check_at`) is decided here, against the decode
headroom the caller passes (the outbox follows it).

Imports nothing of the package but `events` (a placement is a `scheduled` event).
"""

from __future__ import annotations

from typing import NamedTuple

import kvsched.core.lifecycle as lifecycle
from kvsched.core.config import EngineConfig, Role
from kvsched.core.kv_cache_manager import KVCacheManager, _cdiv
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.events import Events
from kvsched.core.slots import SlotTable, set_reported


class Freed(NamedTuple):
    """What `PlacementTable.release` gave back."""

    was_prefilling: bool  # it still had prefill chunks to send (its backlog goes with it)
    num_blocks: int  # blocks returned to the pool
    slot: int  # the slot freed (-1: it held none)


class PlacementTable:
    """Owns the live requests, their slots, handles and running sets, and the prefill debt."""

    def __init__(
        self, config: EngineConfig, kv: KVCacheManager, events: Events, first_handle: int = 0
    ) -> None:
        cc, sc = config.cache, config.scheduler
        self.kv = kv
        self._events = events  # placing a request is its `scheduled` event
        self.block_size = cc.block_size
        self._prealloc_blocks = cc.prealloc_blocks
        self._prealloc_threshold = cc.prealloc_threshold
        self._spec_k = config.speculative.num_speculative_tokens
        self._prefill_role = config.role == Role.PREFILL
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        self.running: dict[str, Request] = {}  # placed, in admission order (LIFO victims)
        self.prefilling: dict[str, Request] = {}  # running with prefill chunks still to send
        self.needs_blocks: dict[str, Request] = {}  # decoding, room at or below threshold
        self.reserved: dict[str, Request] = {}  # decode role: room held for pushed KV
        self.live: dict[int, Request] = {}  # handle -> placed or preempted-awaiting-ack
        self.num_decoding = 0
        self.next_handle = first_handle
        self.first_handle = first_handle
        self.num_slots = sc.max_num_seqs
        self.free_slots = list(range(sc.max_num_seqs - 1, -1, -1))
        self.slots = SlotTable(sc.max_num_seqs)
        # Blocks the admitted prompts still need to finish their prefill (admit_full_prompt).
        self.prefill_debt = 0
        # LoRA adapter -> running requests naming it (the worker's adapters of every step).
        self.loras: dict[str, int] = {}

    # ==== in ==================================================================================
    def track(self, req: Request) -> None:
        """A new request is live (queued)."""
        self.requests[req.req_id] = req

    def place(self, req: Request, num_hit: int, num_swapped: int) -> None:
        """Give req a slot and a fresh handle, its prefill starting after num_hit cached tokens
        (num_swapped of them swapped in from the host tier: reported only once they are)."""
        req.slot = self.free_slots.pop()
        self._issue_handle(req)
        req.num_prefill_tokens = req.num_tokens
        req.num_computed_tokens = num_hit
        set_reported(req, num_hit - num_swapped)
        self.live[req.handle] = req
        self.running[req.req_id] = req
        self.prefilling[req.req_id] = req
        self._lora_in(req)
        self._events.scheduled.append(req)

    def first_placement(
        self, req: Request, num_hit: int, num_swapped: int, num_fetched: int = 0
    ) -> bool:
        """Whether this is req's first placement on this instance; if so its prefix hit (and
        the parts of it the host tier swaps in and the storage tier fetches) is what its usage
        reports."""
        if req.num_cached_tokens >= 0:
            return False
        req.num_cached_tokens = num_hit
        if num_swapped:
            req.num_host_cached_tokens = num_swapped
        if num_fetched:
            req.num_storage_cached_tokens = num_fetched
        return True

    def prefill_all(self, req: Request) -> None:
        """Decode role: a reserved request's prefill covers all its tokens (pushed to it)."""
        req.num_prefill_tokens = req.num_tokens

    def kv_pushed(self, req: Request, num_cached_tokens: int) -> None:
        """Decode role: the pushed KV covers the prompt; decoding starts from the last output
        token, whose KV is not written yet: prefill is done at num_tokens - 1."""
        req.num_cached_tokens = num_cached_tokens
        req.num_prefill_tokens = req.num_tokens - 1
        req.num_computed_tokens = req.num_prefill_tokens
        set_reported(req, req.num_prefill_tokens)

    def computed(self, req: Request, n: int) -> None:
        """req's positions up to n are handed to the worker to compute (a chunk sent)."""
        req.num_computed_tokens = n

    def hold(self, req: Request) -> None:
        """Decode role: a slot and handle for a request whose KV another instance pushes."""
        lifecycle.hold(req)
        req.slot = self.free_slots.pop()
        self._issue_handle(req)
        self.live[req.handle] = req
        self.requests[req.req_id] = req
        self.reserved[req.req_id] = req

    def take_reserved(self, req_id: str) -> Request | None:
        """Decode role: the held request whose KV has arrived (None: none held)."""
        return self.reserved.pop(req_id, None)

    def start_decoding(self, req: Request) -> None:
        """Decode role: a held request decodes now, under a new handle on the same slot."""
        self.live.pop(req.handle, None)
        self._issue_handle(req)
        self.live[req.handle] = req
        self.running[req.req_id] = req
        self.num_decoding += 1
        self._lora_in(req)
        self._events.scheduled.append(req)

    def _lora_in(self, req: Request) -> None:
        if req.lora_name:
            self.loras[req.lora_name] = self.loras.get(req.lora_name, 0) + 1

    def _lora_out(self, req: Request) -> None:
        name = req.lora_name
        if name:
            n = self.loras[name] - 1
            if n:
                self.loras[name] = n
            else:
                del self.loras[name]

    def lora_blocked(self, req: Request, max_loras: int) -> bool:
        """Whether placing req would run more than max_loras distinct adapters (vLLM's rule:
        a request with a new adapter waits while max_loras are running; 0: no limit)."""
        name = req.lora_name
        return bool(max_loras and name and name not in self.loras and len(self.loras) >= max_loras)

    def lora_blocked_held(self, req: Request, max_loras: int) -> bool:
        """Decode role: whether holding req for a hand-off would run more than max_loras
        distinct adapters once the held requests decode (a held request starts decoding the
        moment its KV arrives, unchecked: its adapter counts from the hold on)."""
        name = req.lora_name
        if not (max_loras and name) or name in self.loras:
            return False
        held = self.held_loras()
        return name not in held and len(held | self.loras.keys()) >= max_loras

    def held_loras(self) -> set[str]:
        """Decode role: the adapters of the requests held for a hand-off (O(held))."""
        return {r.lora_name for r in self.reserved.values() if r.lora_name}

    def _issue_handle(self, req: Request) -> None:
        """A fresh handle for req's slot (handle & mask == slot), and the slot table row."""
        req.handle = self.slots.handle_for(req.slot, self.next_handle)
        self.next_handle = req.handle + 1
        self.slots.bind(req)

    def prefill_sent(self, req: Request, threshold: int) -> None:
        """The last chunk of req's prompt was sent: it decodes from now on."""
        del self.prefilling[req.req_id]
        self.num_decoding += 1
        self.set_check_at(req, threshold)

    def admitted_debt(self, req: Request) -> None:
        """req was admitted with part of its blocks: the rest is debt until its chunks come."""
        self.prefill_debt += self.full_blocks(req, req.num_tokens) - len(req.block_ids)

    def paid_debt(self, num_blocks: int) -> None:
        self.prefill_debt -= num_blocks

    def need_blocks(self, req: Request) -> None:
        """A decoding request's room is at or below the headroom: the next step extends it."""
        self.needs_blocks[req.req_id] = req

    def blocks_met(self, req: Request) -> None:
        self.needs_blocks.pop(req.req_id, None)

    # ==== room ================================================================================
    def set_check_at(self, req: Request, threshold: int) -> None:
        """The output count at which this decoding request next needs the scheduler: its room
        falls to `threshold` (the decode headroom), it reaches max_tokens, or its next block
        fills."""
        if self._prefill_role:
            self.slots.set_check(req, 0)  # its first token is a hand-off
            return
        p = len(req.prompt_token_ids)
        capacity = len(req.block_ids) * self.block_size
        finish_at = p + req.sampling.max_tokens
        if capacity >= finish_at - 1:  # it already holds every position it can write
            check_at = finish_at
        else:
            check_at = min(capacity - threshold - self._spec_k, finish_at)
        # Full output blocks are registered in the prefix cache on these visits and when the
        # request leaves its slot, not one visit per block (see release).
        # No output yet: the first token itself needs the slow path (first-token event).
        self.slots.set_check(req, check_at - p if req.output_token_ids else 1)

    def set_check(self, req: Request, out: int) -> None:
        self.slots.set_check(req, out)

    def grow(self, req: Request, threshold: int) -> list[int] | None:
        """Append blocks to a decoding request's table: `prealloc_blocks` more (one more with
        speculative decoding) and room for two round trips of the worker (`threshold`), never
        past the last position it can write. Returns the new block ids ([] when it needs none),
        or None, changing nothing, when the pool has too few free blocks."""
        bs, ids, spec_k = self.block_size, req.block_ids, self._spec_k
        p = len(req.prompt_token_ids)
        limit = _cdiv(p + req.sampling.max_tokens - 1, bs)  # blocks it can ever need
        want = max(
            len(ids) + self._prealloc_blocks + (1 if spec_k else 0),
            _cdiv(p + len(req.output_token_ids) + 2 * threshold + spec_k + 1, bs),
        )
        need = min(want, limit) - len(ids)
        if need <= 0:
            return []
        return self.kv.extend_blocks(req, need)

    def alloc_target(self, req: Request, end: int, num_prefill: int | None = None) -> int:
        """Positions the table must cover once a chunk ending at `end` is scheduled: the chunk,
        plus decode headroom when it is the prompt's last chunk."""
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        if end < total:
            return end
        # First decode writes position `total`; speculative drafts write k more. Never beyond
        # the last position the request can ever write (its last token's KV is never needed).
        # (The configured threshold, not the adaptive one: the prefill debt counts on this
        # target staying fixed while the prompt is in; the first decode visit tops it up.)
        room = end + 1 + self._spec_k + self._prealloc_threshold
        room = max(end, min(room, len(req.prompt_token_ids) + req.sampling.max_tokens - 1))
        return _cdiv(room, self.block_size) * self.block_size

    def full_blocks(self, req: Request, num_prefill: int | None = None) -> int:
        """Blocks req's table holds once its whole prefill (and first decode room) is in."""
        total = req.num_prefill_tokens if num_prefill is None else num_prefill
        return _cdiv(self.alloc_target(req, total, num_prefill=total), self.block_size)

    def enc_needed(self, req: Request, handle: int, content_hash: str) -> bool:
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

    # ==== out =================================================================================
    def release(self, req: Request) -> Freed:
        """Return req's blocks (tail first) and slot, and take it out of the running sets.
        Finish, abort, preempt and hand-off all go through here."""
        rid = req.req_id
        was_prefilling = False
        if self.running.pop(rid, None) is not None:
            self._lora_out(req)
            if self.prefilling.pop(rid, None) is None:
                self.num_decoding -= 1
            else:
                was_prefilling = True
                self.prefill_debt -= self.full_blocks(req) - len(req.block_ids)
            self.needs_blocks.pop(rid, None)
        self.reserved.pop(rid, None)
        n = len(req.block_ids)
        if n:
            self.kv.cache_reported(req)  # written blocks not registered on a visit yet
            self.kv.free(req)
        slot = req.slot
        if slot >= 0:
            self.slots.unbind(req)
            self.free_slots.append(slot)
            req.slot = -1
        return Freed(was_prefilling, n, slot)

    def remove(self, req: Request) -> Freed:
        """req leaves this instance (finished, or handed off): released and no longer live."""
        freed = self.release(req)
        self.live.pop(req.handle, None)
        self.requests.pop(req.req_id, None)
        self.kv.release_prefetch(req)  # a waiting request's prefetch pins (core/prefetch.py)
        return freed

    def forget(self, req: Request) -> None:
        """A waiting request ended (it held nothing but a prefetch's pins)."""
        self.requests.pop(req.req_id, None)
        self.kv.release_prefetch(req)

    def unplace(self, req: Request) -> None:
        """A preempted request's worker acknowledged: its handle is dead, and nothing of its
        KV counts any more (it prefills again from its prefix hit when placed anew)."""
        self.live.pop(req.handle, None)
        req.handle = -1
        req.num_computed_tokens = 0
        set_reported(req, 0)
