"""The scheduler of one instance: policy over a KVCacheManager (see docs/ARCHITECTURE.md).

One call to `schedule()` plans the worker's next-but-one step and returns a `Tasks` message;
one call to `apply_report()` folds a worker's `StepReport` back in and returns what happened
(`Events`). Between them the worker decodes on its own, so a steady decode step costs the
scheduler almost nothing: it only appends reported tokens, and extends a request's blocks when
its free room falls to the prealloc threshold.

`Scheduler` composes owners, each a class in its own module, handed to each other at
construction (none inherits another; each field has one writer):

    table       PlacementTable: live requests, slots, handles, running/prefilling/decoding
                sets, blocks needed, prefill debt; `release` returns what it freed
    outbox      Outbox: what the next Tasks carries (preempts, aborts, placements, extensions,
                reset), message numbering, the round trip and the decode headroom
    step_plan   StepPlan: the step-cost model and the chunks in flight
    backlog     Backlog: the waiting queue, deadlines, shedding, tenants' counters
    groups      SampleGroups: samples of one prompt held until their leader computed it
    exits       Exits: finish, preempt, requeue, hand-off, pause; the admission reserve
    preemption  choose_victim and the reserve's arithmetic (plain functions)
    admission   Admitter: built for each schedule() with the owners passed in; owns the
                step's StepBudget and decides extensions, chunks, admissions
    roles       Roles: the decode role's preallocate / add_prefilled
    report      ReportApplier: apply_report and its tuned hot path
    facts       Facts: what it shows others (snapshot, load facts, the priced hit), read-only
    integrity   check_integrity (tests)
    events      Events and their typed token deltas (`Events.take` hands them out),
                SchedulerStats, SchedulerSnapshot

Imported by `kvsched.core.scheduler` (the package) only; imports the parts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from kvsched.core.config import EngineConfig, Role
from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.errors import RequestNotFound
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.kv_events import KvEvent
from kvsched.core.protocol import FinishReason, StepReport, Tasks
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.admission import Admitter
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import Events, LoraState, SchedulerSnapshot, SchedulerStats
from kvsched.core.scheduler.exits import Exits
from kvsched.core.scheduler.facts import Facts
from kvsched.core.scheduler.groups import SampleGroups
from kvsched.core.scheduler.integrity import check_integrity
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.report import ReportApplier
from kvsched.core.scheduler.roles import Roles
from kvsched.core.scheduler.step_plan import StepPlan
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.scheduler.validation import validate
from kvsched.core.storage import StorageIndex

# Every scheduler made in this process gets the next epoch: an engine whose scheduler is
# replaced (its workers reconnected) shows a new one, and readers know their numbers restarted.
_epochs = itertools.count(1)


class Scheduler:
    """Owns one instance's waiting queue, running set, slots and KV blocks (through its parts).

    Public calls are synchronous and deterministic; `clock` gives timestamps only.
    `first_handle`: where handle numbers start. A scheduler that replaces another for the same
    instance (its workers reconnected) continues the old numbering, so a message still
    addressed to an old handle can never name a new request.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        instance_id: str = "",
        first_handle: int = 0,
        storage: StorageIndex | None = None,
        storage_namespace: str = "",
    ) -> None:
        """storage: the daemon's shared storage index (one per daemon, every scheduler's), or
        None: no storage tier; storage_namespace: the first part of this instance's storage
        keys (its model: equal prefixes of one model are equal keys on every instance)."""
        self.config = config = (config or EngineConfig()).validate()
        self.epoch = next(_epochs)
        self.clock = clock
        self.instance_id = instance_id
        cc = config.cache
        self.block_size = cc.block_size
        self.kv = kv = KVCacheManager(
            cc.block_size,
            cc.num_gpu_blocks,
            cc.enable_prefix_caching,
            cc.num_host_blocks,
            cc.host_write_policy,
            cc.host_write_hits,
            storage,
            storage_namespace,
            cc.storage_write_policy,
            cc.storage_prefetch,
        )
        # The worker's multimodal encoder outputs (None: cache off).
        self.enc = EncoderCache(cc.encoder_cache_size) if cc.encoder_cache_size else None
        self.stats = stats = SchedulerStats()
        self.events = events = Events()  # appended to by the parts; emptied by take_events
        self.table = table = PlacementTable(config, kv, events, first_handle)
        self.outbox = outbox = Outbox(config, stats)
        self.plan = plan = StepPlan(config, table, outbox, kv)
        self.backlog = backlog = Backlog(config, table, plan, kv, clock, instance_id)
        self.exits = exits = Exits(config, table, backlog, outbox, events, stats, clock)
        self.groups = SampleGroups(config, backlog)
        spec_k = config.speculative.num_speculative_tokens
        self.roles = Roles(table, kv, outbox, clock, instance_id, spec_k)
        self.reports = reports = ReportApplier(
            config, table, kv, plan, backlog, exits, outbox, events, stats, clock
        )
        self.facts = Facts(
            config, table, kv, self.enc, plan, backlog, exits, outbox, reports, stats, self.groups
        )
        # The clock time at which a request held for its storage prefetch may be placed anyway
        # (the earliest, set by each schedule(); None: none held): schedule again by then.
        self.hold_until: float | None = None

    # ==== the two verbs =======================================================================
    def schedule(self) -> Tasks:
        """Plan the next step: block extensions, continuing prefill chunks, new admissions.
        Cost O(requests touched), independent of the number waiting. A message with neither
        a task nor a report to answer has seq 0 and is not meant to be sent; the others are
        numbered 1, 2, 3, ... (the worker's applied_seq names them)."""
        tasks = Tasks(seq=0)  # numbered by the outbox if it is to be sent
        exits = self.exits
        self.hold_until = None
        self.plan.new_pass()
        if not exits.paused:
            table = self.table
            # No decoder out of room, no prompt in, no chunk in flight and nothing admissible
            # (a steady decode step): no admitter, only the report visits' extensions go out.
            if (
                table.needs_blocks
                or table.prefilling
                or self.plan.has_outstanding
                or (table.free_slots and self.backlog.waiting)
            ):
                adm = Admitter(
                    self.config,
                    tasks,
                    table,
                    self.kv,
                    self.enc,
                    self.plan,
                    self.backlog,
                    exits,
                    self.outbox,
                    self.events,
                    self.stats,
                    self.clock,
                )
                adm.extend_decoders()
                adm.continue_prefills()
                preempted = adm.budget.preempted
                if not preempted:
                    adm.admit()
                self.hold_until = adm.hold_until
            else:
                preempted = False
                if self.outbox.extended:
                    tasks.extensions = self.outbox.take_extended(table.live)
            if not preempted and table.running:
                exits.decay_reserve()
            self.groups.settle(self.events)  # a leader that ran out of KV hands its lead on
            if self.kv.prefetch is not None and (head := self.backlog.waiting.peek()):
                self.kv.prefetch_for(head, self.clock())  # it waits: its storage hits to host
        budget = self.plan.storage_write_budget() if self.kv.storage is not None else None
        self.outbox.seal(tasks, self.kv, self.enc, self.reports.last_report_step, budget)
        return tasks

    def apply_report(self, report: StepReport) -> Events:
        """Fold a worker's step report in: append tokens, register written blocks in the prefix
        cache, finish what the worker stopped, re-queue acknowledged preemptions. Raises
        ProtocolError (state unchanged) for reports that break the protocol. Returns the events
        since the last call (including those of schedule() and abort())."""
        self.reports.apply(report)
        self.groups.settle(self.events)  # leaders' first tokens release their samples
        return self.take_events()

    def take_events(self) -> Events:
        """The events since the last call (the parts keep appending to `events`)."""
        return self.events.take()

    def validate(self, req: Request) -> None:
        """Raise InvalidRequest naming the first field of `req` this instance refuses, as
        add_request would (ids in use aside); nothing changes."""
        validate(req, self.config, (), self.kv.pool.num_blocks)

    def add_request(self, req: Request) -> None:
        """Queue a new request (a sample of a group whose leader is computing the prompt is
        held until it has: `groups.py`). Raises InvalidRequest (bad fields, duplicate id) or
        CapacityExceeded (the queue is at max_waiting); state is unchanged when it raises.
        With storage_prefetch_at_arrival, its storage hits start coming into host blocks now
        (`KVCacheManager.prefetch_for`; else once it waits at the queue's head)."""
        held = self.groups.waits(req)
        self.backlog.add(req, queued=not held, num_held=self.groups.num_held)
        self.groups.added(req, held)
        if (
            not held
            and self.kv.prefetch is not None
            and self.config.cache.storage_prefetch_at_arrival
        ):
            self.kv.prefetch_for(req, self.clock())

    def abort(
        self, req_id: str, reason: FinishReason = FinishReason.ABORT, message: str = ""
    ) -> Request:
        """End a live request now. A waiting one just finishes; a placed one's blocks are freed
        and the worker is told in the next Tasks (before any task that reuses them). Raises
        RequestNotFound for an id that is not live."""
        req = self.table.requests.get(req_id)
        if req is None:
            raise RequestNotFound(f"no live request with id {req_id!r} (finished or never seen)")
        if self.groups.discard(req):
            pass  # a held sample: never queued
        elif req.status == RequestStatus.WAITING:
            self.backlog.discard(req)
        elif req.handle >= 0:
            self.outbox.abort(req.handle)
        self.exits.finish(req, reason, message or "aborted")
        self.groups.settle(self.events)  # an aborted leader hands its lead on
        return req

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; the worker is told in the next Tasks. Returns the
        number of hashes dropped."""
        n = self.kv.reset_cache(self.table.running.values())  # both tiers
        if self.enc is not None:  # the worker drops every encoder output with it
            self.enc.reset(self.table.enc_needed)
        self.outbox.reset_cache()
        return n

    # ==== KV events (docs/CLUSTER.md) ===========================================================
    def enable_kv_events(self) -> None:
        """Record the prefix cache's changes from now on (`take_kv_events` drains them). The
        first event is AllBlocksCleared: a consumer's view of this instance starts empty."""
        self.kv.pool.record_events()

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events recorded since the last call, oldest first ([] when not enabled)."""
        return self.kv.pool.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (a snapshot for KV-event consumers)."""
        return list(self.kv.pool.cached)

    # ==== the decode role, pausing ============================================================
    def preallocate(self, src: Request) -> tuple[int, list[int]] | None:
        """Decode role: hold a slot and blocks for a request another instance will prefill
        (see roles.Roles.preallocate); None also when its LoRA adapter would be one more than
        max_loras running here once the held requests decode (the table's rule)."""
        if self.table.lora_blocked_held(src, self.config.scheduler.max_loras):
            return None
        return self.roles.preallocate(src)

    def add_prefilled(
        self, req_id: str, output_token_ids: list[int], num_cached_tokens: int
    ) -> Request:
        """Decode role: the KV of a preallocated request has arrived (roles.Roles)."""
        return self.roles.add_prefilled(req_id, output_token_ids, num_cached_tokens)

    def recompute_reserved(self, req_id: str, output_token_ids: list[int]) -> Request:
        """Decode role: the KV push for a preallocated request failed: it is prefilled here
        (prompt and output so far) and decodes on. RequestNotFound when no reservation."""
        req = self.table.take_reserved(req_id)
        if req is None:
            raise RequestNotFound(f"no preallocated request {req_id!r} on {self.instance_id!r}")
        self.exits.recompute_reserved(req, output_token_ids)
        return req

    def trust_stored_prefix(self, req: Request, num_blocks: int) -> None:
        """The first `num_blocks` full blocks of req's prompt are in the shared storage tier
        (a peer daemon stored them for a P/D hand-off): their keys into this daemon's index, so
        req's lookup fetches them (a fetch that fails recomputes, and drops them again)."""
        st = self.kv.storage
        n = min(num_blocks, len(req.prompt_token_ids) // self.block_size)
        if st is None or n <= 0:
            return
        self.kv.ensure_hashes(req, n)
        st.index.add(st.keys(req.block_hashes[:n]))

    def stored_prompt_blocks(self, req: Request) -> int:
        """How many full blocks of req's prompt, from its start, the storage index holds."""
        st = self.kv.storage
        n = len(req.prompt_token_ids) // self.block_size
        if st is None or n <= 0:
            return 0
        self.kv.ensure_hashes(req, n)
        return len(st.run_from(req.block_hashes[:n]))

    def take_stored_hand_offs(self) -> list[Request]:
        """Prefill role handing off through the storage tier: the requests whose writes are
        not acknowledged yet (taken: the instance is lost; the decode side recomputes them)."""
        ho = self.reports.stored_hand_offs
        return ho.take_pending() if ho is not None else []

    def pause(self) -> list[Request]:
        """Preempt everything running and hold admissions (around weight updates)."""
        return self.exits.pause()

    def resume(self) -> None:
        self.exits.resume()

    # ==== introspection (read-only views of the parts) ========================================
    @property
    def last_tasks_seq(self) -> int:
        return self.outbox.seq

    @property
    def last_report_step(self) -> int:
        return self.reports.last_report_step

    @property
    def num_waiting(self) -> int:
        return len(self.backlog.waiting)

    @property
    def num_held(self) -> int:
        """Samples waiting for their group's leader to compute the prompt (`groups.py`)."""
        return self.groups.num_held

    def leads_group(self, group: str) -> bool:
        """Whether a request of sample group `group` computes its prompt here now."""
        return self.groups.leads(group)

    @property
    def num_running(self) -> int:
        return len(self.table.running)

    @property
    def paused(self) -> bool:
        return self.exits.paused

    @property
    def is_decode(self) -> bool:
        return self.config.role == Role.DECODE

    @property
    def requests(self) -> dict[str, Request]:
        return self.table.requests

    @property
    def running(self) -> dict[str, Request]:
        return self.table.running

    @property
    def live(self) -> dict[int, Request]:
        return self.table.live

    @property
    def prefilling(self) -> dict[str, Request]:
        return self.table.prefilling

    @property
    def needs_blocks(self) -> dict[str, Request]:
        return self.table.needs_blocks

    @property
    def reserved(self) -> dict[str, Request]:
        return self.table.reserved

    @property
    def free_slots(self) -> list[int]:
        return self.table.free_slots

    @property
    def slots(self) -> Any:
        """The slot table (kvsched.core.slots.SlotTable), the placement table's."""
        return self.table.slots

    @property
    def num_decoding(self) -> int:
        return self.table.num_decoding

    @property
    def next_handle(self) -> int:
        return self.table.next_handle

    @property
    def waiting(self) -> Any:
        """The waiting queue (kvsched.core.queue / fairness: read it, queue through
        add_request)."""
        return self.backlog.waiting

    @property
    def tenants(self) -> Any:
        return self.backlog.tenants

    @property
    def num_shed(self) -> int:
        return self.backlog.num_shed

    @property
    def num_demoted(self) -> int:
        return self.backlog.num_demoted

    @property
    def queued_prefill_ms(self) -> float:
        return self.backlog.queued_prefill_ms

    def predicted_backlog_ms(self) -> float:
        return self.backlog.predicted_backlog_ms()

    def predicted_wait_ms(self, req: Request, hit_tokens: int | None = None) -> float:
        """With hit_tokens: as if req were queued here now with that many cached (routing)."""
        return self.backlog.predicted_wait_ms(req, hit_tokens)

    def priced_hit(self, req: Request) -> tuple[float, int]:
        """(tokens req's hit is worth here, tokens cached in any tier): `Facts.priced_hit`."""
        return self.facts.priced_hit(req)

    def host_block_hashes(self) -> list[bytes]:
        """Every hash the host-memory tier holds now ([] without one)."""
        return self.facts.host_block_hashes()

    def lora_state(self) -> LoraState:
        """The LoRA adapters running and queued here, and max_loras: `Facts.lora_state`."""
        return self.facts.lora_state()

    def lora_affinity(self, req: Request) -> int:
        """2 adapter loaded here, 1 a free adapter slot, 0 neither: `Facts.lora_affinity`."""
        return self.facts.lora_affinity(req)

    @property
    def cost(self) -> Any:
        """The step-cost model (kvsched.core.step_cost.StepCostModel)."""
        return self.plan.cost

    @property
    def itl_target_ms(self) -> float:
        return self.plan.itl_target_ms

    @property
    def decode_headroom(self) -> int:
        """Room (tokens) at which a decoding request gets more blocks now (Outbox.lag)."""
        return self.outbox.threshold

    @property
    def reserve_blocks_per_running(self) -> int:
        """The admission reserve in force now (0 once relaxed)."""
        return self.exits.reserve_blocks_per_running

    def snapshot(self) -> SchedulerSnapshot:
        """The numbers the daemon's status, admin and metrics show, read at once."""
        return self.facts.snapshot()

    def load_facts(self, queued: bool = False) -> dict[str, float]:
        """The numbers an instance's load is computed from (`kvsched.core.router.instance_load`)
        and a cluster publishes; `queued`: with the prompt tokens waiting (O(waiting))."""
        return self.facts.load_facts(queued)

    def published_load(self) -> dict[str, float]:
        """The load facts a cluster publishes (with the queued prompt tokens; rounded)."""
        return self.facts.published_load()

    def prefix_hit_tokens(self, req: Request) -> int:
        """Tokens of req's prompt this instance holds cached now (for routing); no side effects."""
        return self.kv.hit_tokens(req)

    def close(self) -> None:
        """The scheduler is dropped (its instance lost): release what it holds in state shared
        with other schedulers (its storage writes' claims in the daemon's StorageIndex)."""
        if self.kv.storage is not None:
            self.kv.storage.abandon()

    def check_integrity(self) -> None:
        """Assert every invariant of the scheduler's state (O(everything): tests only)."""
        check_integrity(self.table, self.backlog, self.kv, self.enc, list(self.groups.held()))
        self.groups.check_integrity(self.table.requests)
