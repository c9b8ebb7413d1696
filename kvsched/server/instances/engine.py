"""One instance's engine loop: owns its Scheduler, talks to its worker ranks.

The only module above `kvsched.core` that holds a Scheduler (tests/test_layout.py; `instance_start`
builds it, `engine_totals` keeps the counters of those taken out, `report_inbox` the reports
not applied yet, `engine_events` routes its events upward): the layers
above call its methods (add_request, abort, pause, ...), hear back through an `EngineListener`
(the request table), and read the facts it publishes (snapshot, its load value, epoch, counters,
KV events). It imports nothing above it.

    worker rank 0 --StepReport--> reports ─┐
    front ends --add/abort (direct calls)--├─> wake ─> loop: apply_report* ─> schedule() ─> Tasks
                                                                    │                     │
                                              dispatch Events to request sinks     same bytes to
                                                                                   every rank

Core calls are synchronous and never await, so handlers may call `scheduler.add_request` /
`abort` directly (one asyncio thread: nothing interleaves inside a call); the loop batches the
rest. Every wake runs at most one `schedule()`, so a burst of reports or arrivals costs one step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from kvsched import codec
from kvsched.core import (
    EngineConfig,
    FinishReason,
    ProtocolError,
    Request,
    Role,
    Scheduler,
    SchedulerSnapshot,
    StorageIndex,
    Unavailable,
)
from kvsched.core.protocol import StepReport
from kvsched.core.router import LOAD_SECONDS, instance_load
from kvsched.server.instances.events import EngineListener, EventDispatch
from kvsched.server.instances.inbox import ReportInbox
from kvsched.server.instances.ranks import RankConn, check_joining_rank
from kvsched.server.instances.start import learned_cost, start_scheduler
from kvsched.server.instances.totals import RetiredTotals
from kvsched.server.telemetry.values import InstanceFacts, InstanceInfo, StepStats

__all__ = ["InstanceEngine", "RankConn"]

if TYPE_CHECKING:
    from kvsched.server.telemetry.hooks import Telemetry

log = logging.getLogger("kvsched.engine")


class InstanceEngine:
    def __init__(
        self,
        listener: EngineListener[InstanceEngine],
        telemetry: Telemetry,
        instance_id: str,
        engine_config: EngineConfig,
        world_size: int = 1,
        load_seconds: float = LOAD_SECONDS,
    ) -> None:
        self.listener = listener
        self.telemetry = telemetry
        self.instance_id = instance_id
        self.engine_config = engine_config
        self.role = engine_config.role
        # What telemetry's step hooks are told of this instance (a value; made anew with
        # each scheduler).
        self.info = InstanceInfo(instance_id, self.role, engine_config.fairness.tenant_weights)
        self.world_size = world_size
        self.ranks: dict[int, RankConn] = {}
        self.sched: Scheduler | None = None
        self.draining = False
        self.kv_events = False  # record the prefix cache's changes (a cluster publishes them)
        self.limits: Any = None  # server.models.Limits from the first rank's Hello (registry)
        # The cluster lease's fencing token, set by the registry at attach (0: unfenced);
        # stamped on the Welcome and every Tasks message.
        self.fencing_epoch = 0
        # The daemon's shared storage index and its backend kind, set by the registry (None:
        # no storage tier); used when every rank's Hello lists the kind.
        self.storage_index: StorageIndex | None = None
        self.storage_kind = ""
        # The instance's one load value (`load`): `instance_load` of its scheduler's facts at
        # `load_seconds` (by count for a decode instance), computed again only after a step or
        # a call that changed them (None: stale).
        self.load_seconds = load_seconds
        self._load: float | None = None
        self._next_handle = 0  # handles continue across schedulers of this instance
        # Step-cost coefficients the next scheduler starts from (None: the config's seed): its
        # previous scheduler's fit, or one the registry hands on from a sibling instance.
        self.cost_seed: tuple[float, ...] | None = None
        # Final counters of the schedulers taken out (SNAPSHOT_COUNTERS; tenants' served / shed).
        self._retired = RetiredTotals()
        self._inbox = ReportInbox()
        self._hold_timer: asyncio.TimerHandle | None = None  # see _wake_when_held
        self._dispatch = EventDispatch(self, listener, telemetry)
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"engine-{instance_id}"
        )

    # ---- readiness --------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.sched is not None

    @property
    def accepting(self) -> bool:
        """Takes new requests and schedules them now."""
        return self.sched is not None and not self.draining and not self.sched.paused

    def sinks_changed(self) -> None:
        """A tracked request's sink was replaced (Resume): drop the cached sink grouping."""
        self._dispatch.forget_sinks()

    @property
    def queueing(self) -> bool:
        """Takes new requests, if only into its queue (paused: until Resume)."""
        return self.sched is not None and not self.draining

    def attach(self, conn: RankConn, world_size: int) -> None:
        """Register a rank that said Hello; the instance becomes ready with its last rank."""
        check_joining_rank(conn, world_size, self.world_size, self.ranks, self.instance_id)
        if len(self.ranks) + 1 == self.world_size:
            self._start([*self.ranks.values(), conn])  # may raise: then nothing is registered
        self.ranks[conn.rank] = conn
        if self.sched is not None:
            self.listener.on_instance_ready(self)
            self.wake()

    def _start(self, conns: list[RankConn]) -> None:
        storage = (self.storage_index, self.storage_kind)
        self.sched = start_scheduler(
            self.instance_id,
            self.engine_config,
            conns,
            self.limits,
            storage,
            self._next_handle,
            self.cost_seed,
        )
        self._load = None
        self.info = InstanceInfo(
            self.instance_id, self.role, self.sched.config.fairness.tenant_weights
        )
        if self.kv_events:
            self.sched.enable_kv_events()

    def take_out(
        self, reason: str, error: Exception | None = None, worker_fault: bool = True
    ) -> None:
        """The instance is lost (a rank dropped, went silent, or broke the protocol): close
        every rank's stream and end every request it held with an error the client sees.
        `worker_fault` False: the loss is the cluster's (its lease was taken, a rank went
        silent: a pause or a partition), never counted against its requests (poison.py)."""
        sched, self.sched = self.sched, None
        self._load = None
        if sched is not None:
            sched.close()  # its storage writes' claims in the daemon's shared index
            self._next_handle = sched.next_handle
            self.cost_seed = learned_cost(sched) or self.cost_seed
            self._retired.retire(sched.snapshot(), sched.tenants.served, sched.tenants.shed)
        for conn in self.ranks.values():
            if not conn.closed:
                conn.closed = True
                conn.queue.put_nowait(error if error is not None else Unavailable(reason))
        self.ranks.clear()
        self._inbox.clear()
        if sched is None:
            return
        log.warning("instance %s taken out: %s", self.instance_id, reason)
        # Deliver what the scheduler already produced, then move its live requests elsewhere:
        # none of this instance's blocks is used again until its workers register anew.
        self._dispatch(sched.take_events())
        self._dispatch.forget_sinks()  # let go of the lost scheduler's last batch
        for req in sched.take_stored_hand_offs():  # their writes may not have run
            self.listener.on_hand_off_failed(self, req)
        for req in list(sched.requests.values()):
            self.listener.requeue_lost(
                req, f"instance {self.instance_id} lost: {reason}", worker_fault
            )

    def close(self) -> None:
        """Stop the engine loop of an instance the registry forgot (no worker, no request)."""
        self._task.cancel()

    def detach(self, conn: RankConn, reason: str) -> None:
        if self.ranks.get(conn.rank) is conn:
            self.take_out(reason)

    # ---- the loop ---------------------------------------------------------------------------
    def wake(self) -> None:
        self._inbox.wake()

    def submit_report(self, report: StepReport) -> None:
        self._inbox.submit(report)

    async def _loop(self) -> None:
        while True:
            await self._inbox.wait()
            try:
                self.step()
            except Exception as exc:  # a bug must not kill the loop silently
                log.exception("engine %s step failed", self.instance_id)
                self.take_out(f"internal error: {exc!r}", ProtocolError(str(exc)))

    def step(self) -> None:
        """Fold in every pending report, schedule once, send the tasks to every rank."""
        sched = self.sched
        if sched is None:
            return
        reports = self._inbox.take()
        iid, stats = self.instance_id, sched.stats
        try:
            telemetry = self.telemetry
            for report in reports:
                events = sched.apply_report(report)
                self._load = None  # a report and a schedule() change what the load is from
                self._dispatch(events)
                telemetry.report_applied(
                    StepStats(iid, sched.epoch, stats.num_generation_tokens, len(report.handles))
                )
        except ProtocolError as exc:
            self.take_out(f"protocol violation: {exc}", exc)
            return
        t0 = time.perf_counter()
        tasks = sched.schedule()
        self._load = None
        seconds = time.perf_counter() - t0
        telemetry.scheduler_step(
            StepStats(iid, sched.epoch, stats.num_generation_tokens, 0, seconds)
        )
        self._dispatch(sched.take_events())
        if sched.hold_until is not None:
            self._wake_when_held(sched.hold_until)
        # Reports applied are always answered (Tasks.report_step), even with nothing to do:
        # the worker paces its reports by these answers. The core numbers exactly the
        # messages worth sending (seq 0: no task and no report to answer).
        if tasks.seq:
            data = codec.tasks_to_bytes(tasks, self.fencing_epoch)
            for conn in self.ranks.values():
                conn.queue.put_nowait(data)

    def _wake_when_held(self, until: float) -> None:
        """A request waits in the queue for its storage prefetch until `until` (the
        scheduler's clock, time.monotonic): step again then even if no report comes."""
        t = self._hold_timer
        if t is not None and not t.cancelled() and t.when() <= until:
            return
        if t is not None:
            t.cancel()
        loop = asyncio.get_running_loop()
        self._hold_timer = loop.call_later(max(0.0, until - time.monotonic()), self.wake)

    # ---- requests (the scheduler's, for the layers above) ------------------------------------
    # Core calls are synchronous: a caller on the event loop may make them between two steps.
    # The caller wakes the loop (`wake`) when the step should see the change.
    def add_request(self, req: Request) -> None:
        """Queue a new (or a lost instance's) request; raises the core's typed errors."""
        assert self.sched is not None
        self._load = None
        self.sched.add_request(req)

    def leads_group(self, group: str) -> bool:
        """Whether a request of sample group `group` computes its prompt here now."""
        return self.sched is not None and self.sched.leads_group(group)

    def holds(self, req: Request) -> bool:
        """Whether this instance's scheduler holds this very Request object."""
        sched = self.sched
        return sched is not None and sched.requests.get(req.req_id) is req

    def abort(self, req_id: str, reason: FinishReason, message: str) -> None:
        """End a request the scheduler holds; RequestNotFound when it holds none by that id."""
        assert self.sched is not None
        self._load = None
        self.sched.abort(req_id, reason, message)

    def preallocate(self, req: Request) -> tuple[int, list[int]] | None:
        """Decode role: reserve a slot and blocks for `req`'s hand-off (None: no room now)."""
        assert self.sched is not None
        self._load = None
        return self.sched.preallocate(req)

    def add_prefilled(
        self, req_id: str, output_token_ids: list[int], num_cached_tokens: int
    ) -> Request:
        """Decode role: the request prefilled elsewhere takes its reservation; RequestNotFound
        when the reservation is gone."""
        assert self.sched is not None
        self._load = None
        return self.sched.add_prefilled(req_id, output_token_ids, num_cached_tokens)

    def recompute_reserved(self, req_id: str, output_token_ids: list[int]) -> Request:
        """Decode role: the KV push for the reservation failed: the request is prefilled here
        instead; RequestNotFound when the reservation is gone."""
        assert self.sched is not None
        self._load = None
        return self.sched.recompute_reserved(req_id, output_token_ids)

    # ---- admin ------------------------------------------------------------------------------
    def trust_stored(self, req: Request, num_blocks: int) -> None:
        """P/D across daemons: a peer stored the first `num_blocks` full blocks of req's
        prompt in the shared storage tier (its Generate says so): believe them stored here."""
        if self.sched is not None:
            self.sched.trust_stored_prefix(req, num_blocks)

    def stored_prompt_blocks(self, req: Request) -> int:
        """Full blocks of req's prompt, from its start, the storage tier holds (0: none, or
        no scheduler or storage tier here)."""
        return self.sched.stored_prompt_blocks(req) if self.sched is not None else 0

    def drain(self) -> None:
        """Take no new requests; the running ones finish."""
        self.draining = True

    def pause(self) -> None:
        if self.sched is not None:
            self._load = None
            self.sched.pause()

    def resume(self) -> None:
        """Lift a drain and a pause."""
        self.draining = False
        if self.sched is not None:
            self._load = None
            self.sched.resume()

    def reset_prefix_cache(self) -> None:
        if self.sched is not None:
            self._load = None
            self.sched.reset_prefix_cache()

    # ---- status -----------------------------------------------------------------------------
    def snapshot(self) -> SchedulerSnapshot | None:
        """The scheduler's numbers for status and metrics; None while the instance is not up."""
        return None if self.sched is None else self.sched.snapshot()

    # ---- facts (all the layers above read of the scheduler) ---------------------------------
    @property
    def epoch(self) -> int:
        """Changes whenever the scheduler is replaced (0: none now)."""
        return 0 if self.sched is None else self.sched.epoch

    @property
    def paused(self) -> bool:
        return self.sched is not None and self.sched.paused

    def load_facts(self) -> dict[str, float]:
        """What this instance's load is computed from (`kvsched.core.router.instance_load`)."""
        return {} if self.sched is None else self.sched.load_facts()

    def learned_cost(self) -> tuple[float, ...] | None:
        """The step-cost fit its scheduler has learned (None: not up, or too few steps yet)."""
        return None if self.sched is None else learned_cost(self.sched)

    @property
    def load(self) -> float:
        """This instance's one load value, the number every router reads of it (local routing,
        cluster routing, and its peers through `published_load`): `instance_load` of its
        scheduler's facts, by count for a decode instance (it queues no prefill); 0 while it
        is not up. Computed once after each step or call that changed those facts."""
        got = self._load
        if got is None:
            by_count = self.is_decode
            got = self._load = instance_load(self.load_facts(), self.load_seconds, by_count)
        return got

    def published_load(self) -> dict[str, float]:
        """What a cluster publishes of this instance's load ({} while it is not up): its facts
        with the step-cost model peers price its hits with, and its load value (`load`)."""
        if self.sched is None:
            return {}
        facts = self.sched.published_load()
        facts["load"] = round(self.load, 6)
        return facts

    def validate(self, req: Request) -> None:
        """InvalidRequest naming the first field of `req` out of range here (nothing changes)."""
        if self.sched is not None:
            self.sched.validate(req)

    def prefix_hit_tokens(self, req: Request) -> int:
        return 0 if self.sched is None else self.sched.prefix_hit_tokens(req)

    def priced_hit(self, req: Request) -> tuple[float, int]:
        """(tokens req's hit is worth here, tokens cached in either tier) for routing."""
        return (0.0, 0) if self.sched is None else self.sched.priced_hit(req)

    def predicted_wait_ms(self, req: Request, hit_tokens: int) -> float:
        """Predicted ms to req's first token if queued here now (inf while not up)."""
        sched = self.sched
        return float("inf") if sched is None else sched.predicted_wait_ms(req, hit_tokens)

    def lora_affinity(self, req: Request) -> int:
        """2 req's LoRA adapter is loaded here, 1 a free adapter slot, 0 neither (routing)."""
        return 0 if self.sched is None else self.sched.lora_affinity(req)

    def lora_slots(self) -> tuple[int, list[str]]:
        """Its max_loras (0: no limit) and the LoRA adapters of the requests running or
        queued here now, sorted (what a cluster publishes for adapter-affinity routing)."""
        if self.sched is None:
            return 0, []
        st = self.sched.lora_state()
        return st.max_loras, sorted(st.running.keys() | st.waiting.keys())

    def host_block_hashes(self) -> list[bytes]:
        """Every hash this instance's host-memory tier holds now ([] without one)."""
        return [] if self.sched is None else self.sched.host_block_hashes()

    @property
    def block_size(self) -> int:
        return 0 if self.sched is None else self.sched.block_size

    @property
    def last_tasks_seq(self) -> int:
        return -1 if self.sched is None else self.sched.last_tasks_seq

    def facts(self) -> InstanceFacts:
        """What this instance publishes for a scrape (telemetry reads this value, never the
        engine): readiness, its scheduler's snapshot, and the totals over every scheduler."""
        sched = self.sched
        served, shed = self.tenant_counts()
        return InstanceFacts(
            ready=sched is not None,
            accepting=self.accepting,
            epoch=self.epoch,
            generation_tokens=0 if sched is None else sched.stats.num_generation_tokens,
            snapshot=self.snapshot(),
            counters=self.counters(),
            served=served,
            shed=shed,
            tenant_weights=self.info.tenant_weights,
            model=self.limits.model if self.limits is not None else "",
            lora=None if sched is None else sched.lora_state(),
        )

    def counters(self) -> dict[str, int]:
        """SNAPSHOT_COUNTERS totalled over every scheduler this instance has had."""
        return self._retired.counters(self.snapshot())

    def tenant_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Tokens served and requests shed per tenant, over every scheduler it has had."""
        return self._retired.tenant_counts(None if self.sched is None else self.sched.tenants)

    def enable_kv_events(self) -> None:
        if self.sched is not None:
            self.sched.enable_kv_events()

    def take_kv_events(self) -> list[Any]:
        return [] if self.sched is None else self.sched.take_kv_events()

    def cached_block_hashes(self) -> list[bytes]:
        return [] if self.sched is None else self.sched.cached_block_hashes()

    @property
    def reports(self) -> list[StepReport]:
        """The reports queued for the engine loop, not applied yet (a copy)."""
        return self._inbox.pending()

    def steps_per_s(self) -> float:
        return self._inbox.steps_per_s()

    def peers(self) -> list[tuple[str, int, str]]:
        return [(self.instance_id, c.rank, c.address) for c in self.ranks.values() if c.address]

    @property
    def is_decode(self) -> bool:
        return self.role == Role.DECODE
