"""Prefill/decode disaggregation: the decode role's side (`preallocate` room for a request
another instance prefills, then `add_prefilled` when its KV has arrived). (The prefill role's
hand-off, the prompt done and its KV sent, is one of the ways out: `exits.Exits.hand_off`.)

Imports `table` and `outbox`; the scheduler facade holds one `Roles`.
"""

from __future__ import annotations

from collections.abc import Callable

import kvsched.core.lifecycle as lifecycle
from kvsched.core.errors import RequestNotFound
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import Placement
from kvsched.core.request import Request
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.slots import set_output


class Roles:
    """The decode role's ways in (owns nothing: the table places, the outbox carries)."""

    def __init__(
        self,
        table: PlacementTable,
        kv: KVCacheManager,
        outbox: Outbox,
        clock: Callable[[], float],
        instance_id: str,
        spec_k: int,
    ) -> None:
        self._table, self._kv, self._outbox = table, kv, outbox
        self._spec_k = spec_k
        self._clock, self._instance_id = clock, instance_id

    def preallocate(self, src: Request) -> tuple[int, list[int]] | None:
        """Decode role: hold a slot and blocks for a request another instance will prefill and
        push here. Returns (handle, block ids) for the prefill worker's KvSend, or None when
        there is no room now (nothing changes). The request is tracked here as `src.req_id`."""
        table = self._table
        if not table.free_slots or src.req_id in table.requests:
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
            src.ttft_deadline_ms,
            src.tenant,
        )
        table.prefill_all(req)
        target = table.alloc_target(req, req.num_tokens)
        if self._kv.allocate_slots(req, target) is None:
            return None
        table.hold(req)
        self._outbox.place(
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
        table, outbox = self._table, self._outbox
        req = table.take_reserved(req_id)
        if req is None:
            raise RequestNotFound(
                f"no preallocated request {req_id!r} on instance {self._instance_id!r}"
            )
        outbox.abort(req.handle)
        set_output(req, output_token_ids)
        lifecycle.scheduled_again(req, self._clock())
        table.kv_pushed(req, num_cached_tokens)
        table.start_decoding(req)
        self._kv.cache_reported(req)
        outbox.place(
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
        table.set_check_at(req, outbox.threshold)
        room = len(req.block_ids) * table.block_size - req.num_tokens
        if room <= outbox.threshold + self._spec_k:
            table.need_blocks(req)
        return req
