"""Prefill/decode disaggregation: the decode role's side (`preallocate` room for a request
another instance prefills, then `add_prefilled` when its KV has arrived) and the prefill role's
hand-off (`_hand_off`: the prompt is done and its KV sent, the request leaves this instance).

Imported by the report path (hand-off) and the scheduler facade; imports only `placement`.
"""

from __future__ import annotations

from kvsched.core.errors import RequestNotFound
from kvsched.core.protocol import Placement
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.placement import Placements


class Roles(Placements):
    """The prefill/decode roles' ways in and out (owns nothing beyond `Placements`)."""

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
            src.ttft_deadline_ms,
            src.tenant,
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

    def _hand_off(self, req: Request) -> None:
        """Prefill role: req's first token is reported, so its KV has been pushed to the decode
        instance; it leaves here without finishing."""
        self.live.pop(req.handle, None)
        self._release(req)
        self.requests.pop(req.req_id, None)
        self.events.handed_off.append(req)
