"""What a scheduler tells its caller: the events of a step (`Events`, with typed token deltas),
its running counters (`SchedulerStats`) and a read-only view of its state (`SchedulerSnapshot`).

Plain data (`Events.take` hands a step's lists out and starts fresh ones): every module of the
scheduler package may import this one, and so may the server (through
`kvsched.core.scheduler`). It imports nothing of the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np

from kvsched.core.protocol import FinishReason
from kvsched.core.request import Request


class DecodeColumn(NamedTuple):
    """The plain decode rows of one report round, one token each: `tokens[i]` belongs to
    `reqs[slots[i]]`. `reqs` is the slot table's snapshot as it was (SlotTable.snapshot: the same
    list object until a slot changes hands, so a consumer may key a lookup cache on it)."""

    reqs: list[Request | None]
    slots: np.ndarray  # int64 slot numbers
    tokens: np.ndarray  # int64 token ids, one per slot


class RowTokens(NamedTuple):
    """New tokens of one request, from a row taken one by one. `slots` is always None: every
    delta unpacks as (requests, slots, tokens), and None there marks the single-row shape."""

    req: Request
    slots: None
    tokens: list[int]


# A request's deltas are in report order, and each of its tokens is in exactly one delta.
TokenDelta = DecodeColumn | RowTokens


@dataclass(slots=True)
class Events:
    """What changed since the last time events were taken. Requests carry their own state
    (tokens, status, timings); the lists say which ones to look at."""

    scheduled: list[Request] = field(default_factory=list)  # placed on a slot (again after preempt)
    first_token: list[Request] = field(default_factory=list)
    tokens: list[TokenDelta] = field(default_factory=list)  # new output tokens, in report order
    preempted: list[Request] = field(default_factory=list)  # preemption decided
    requeued: list[Request] = field(default_factory=list)  # preemption acknowledged, waiting again
    finished: list[Request] = field(default_factory=list)
    handed_off: list[Request] = field(default_factory=list)  # prefill role: prompt done, KV sent
    # prefill role: prompt done, its KV push failed: the decode side recomputes it
    hand_off_failed: list[Request] = field(default_factory=list)
    # prefill role: prompt done, its full blocks stored in the storage tier (pd_storage.py):
    # the decode side fetches them
    handed_off_stored: list[Request] = field(default_factory=list)
    out_of_blocks: list[Request] = field(default_factory=list)  # a worker slot paused for blocks
    host_hits: list[Request] = field(default_factory=list)  # placed with a tier hit (host, storage)

    @property
    def token_reqs(self) -> list[Request]:
        """The request of every delta (a request once per delta), in order."""
        out: list[Request] = []
        for d in self.tokens:
            if isinstance(d, RowTokens):
                out.append(d.req)
            else:
                reqs = d.reqs
                out.extend(r for r in map(reqs.__getitem__, d.slots.tolist()) if r is not None)
        return out

    def take(self) -> Events:
        """The events so far, handed out (the scheduler's `take_events`): a new `Events` holds
        the lists that have something, and this one starts a fresh list for each of those
        only; an empty kind is the one shared empty list in the taken value. The taken
        `Events` is read, never appended to. No Python call per kind: a steady decode step
        has one or two kinds with news."""
        out = object.__new__(Events)
        for name in _EVENT_LISTS:
            got = getattr(self, name)
            if got:
                setattr(self, name, [])
                setattr(out, name, got)
            else:
                setattr(out, name, _NOTHING)
        return out


_EVENT_LISTS = tuple(f.name for f in fields(Events))  # every field of Events is a list
_NOTHING: list[Any] = []  # the taken value's empty kinds (shared; never appended to)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since the scheduler was made (the daemon adds up successive schedulers)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_preemption_skips: int = 0  # victims spared because they hit max_preemptions
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[FinishReason, int] = field(default_factory=dict)
    num_draft_tokens: int = 0  # speculative drafts verified, and of them accepted
    num_accepted_drafts: int = 0

    # Counted here only (each part calls the verb; nothing else writes a counter).
    def count_step(self) -> None:
        self.num_steps += 1

    def count_prompt(self, n: int) -> None:
        self.num_prompt_tokens += n

    def count_generated(self, n: int) -> None:
        self.num_generation_tokens += n

    def count_drafts(self, drafts: int, accepted: int) -> None:
        self.num_draft_tokens += drafts
        self.num_accepted_drafts += accepted

    def count_preemption(self) -> None:
        self.num_preemptions += 1

    def count_preemption_skip(self) -> None:
        self.num_preemption_skips += 1

    def count_finished(self, reason: FinishReason) -> None:
        fin = self.num_finished
        fin[reason] = fin.get(reason, 0) + 1


# The snapshot's monotonic counters: what restarts at 0 with a new scheduler, and what the daemon
# totals over the schedulers an instance has had (server/instances/engine.py `counters`).
SNAPSHOT_COUNTERS = (
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
    "num_preemptions",
    "num_prompt_tokens",
    "num_generation_tokens",
    "prefix_cache_host_hit_tokens",
    "num_swap_outs",
    "num_swap_ins",
    "prefix_cache_storage_hit_tokens",
    "num_storage_writes",
    "num_storage_fetches",
    "num_storage_write_failures",
    "num_storage_fetch_failures",
    "num_storage_fetches_declined",
    "num_storage_prefetches",
    "num_storage_prefetch_failures",
    "prefix_cache_prefetched_hit_tokens",
    "encoder_cache_hits",
    "encoder_cache_misses",
    "num_draft_tokens",
    "num_accepted_drafts",
    "num_steps_over_target",
)


@dataclass(frozen=True, slots=True)
class LoraState:
    """An instance's LoRA adapters now, as vLLM's `vllm:lora_requests_info` shows them: its
    limit (`max_loras`, 0: none), the adapters of its running requests and of its queued ones
    (name -> requests)."""

    max_loras: int
    running: dict[str, int]
    waiting: dict[str, int]


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Everything the daemon's status, admin and metrics read from a scheduler, taken at once
    (`Scheduler.snapshot()`): numbers only, nothing that changes afterwards."""

    num_waiting: int
    num_running: int
    num_slots: int
    num_slots_used: int
    num_gpu_blocks: int
    num_free_blocks: int
    kv_cache_usage: float  # fraction of blocks in use (free cached blocks count as free)
    num_steps: int
    num_preemptions: int
    num_preemption_skips: int
    num_prompt_tokens: int
    num_generation_tokens: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    paused: bool
    decode_headroom: int  # tokens of room at which a decoding request gets more blocks
    reserve_blocks_per_running: int  # the admission reserve in force
    last_report_step: int
    last_tasks_seq: int
    # The step-cost model (kvsched.core.step_cost): the newest learned worker step's predicted
    # milliseconds (made before learning from it) and measured ones, their moving averages, the
    # coefficients (ms per unit, in step_cost.FEATURES order), and the time target in force.
    step_predicted_ms: float = 0.0
    step_measured_ms: float = 0.0
    step_predicted_ewma_ms: float = 0.0
    step_measured_ewma_ms: float = 0.0
    step_cost_coefficients: tuple[float, ...] = ()
    itl_target_ms: float = 0.0  # 0: time-budgeted steps off
    # The step target last planned to: itl_target_ms, or longer while prompts wait behind
    # decodes that fill it (scheduler.queue_drain_steps); and the measured worker steps with
    # decodes that ran past itl_target_ms (single-step reports; whatever the cause: the
    # stretch, the min_prefill_chunk floor, a misprediction).
    step_target_ms: float = 0.0
    num_steps_over_target: int = 0
    # The host-memory KV tier (0 blocks: none). Hit tokens above count either tier; these count
    # those from host memory. Swaps are blocks copied (sent), failures those the worker failed.
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    host_cache_usage: float = 0.0
    prefix_cache_host_hit_tokens: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_failures: int = 0
    num_swap_ins_declined: int = 0
    # The shared storage tier (core/storage.py; all 0 without one): hit tokens fetched from it,
    # writes and fetches sent (blocks), those the worker failed, storage hits recomputed instead.
    storage_enabled: bool = False
    prefix_cache_storage_hit_tokens: int = 0
    num_storage_writes: int = 0
    num_storage_fetches: int = 0
    num_storage_write_failures: int = 0
    num_storage_fetch_failures: int = 0
    num_storage_fetches_declined: int = 0
    # Storage -> host prefetches (core/prefetch.py): blocks sent, failed, and the storage hit
    # tokens above that a prefetch brought before placement (the rest were fetched on a step).
    num_storage_prefetches: int = 0
    num_storage_prefetch_failures: int = 0
    prefix_cache_prefetched_hit_tokens: int = 0
    # The multimodal encoder cache (0 when off): capacity and use in embeddings, item counts.
    encoder_cache_size: int = 0
    encoder_cache_used: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoder_cache_evictions: int = 0
    # Speculative decoding: drafts the worker verified, and of them accepted.
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
