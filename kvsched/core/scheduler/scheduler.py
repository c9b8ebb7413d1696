"""The scheduler of one instance: policy over a KVCacheManager (see docs/ARCHITECTURE.md).

One call to `schedule()` plans the worker's next-but-one step and returns a `Tasks` message;
one call to `apply_report()` folds a worker's `StepReport` back in and returns what happened
(`Events`). Between them the worker decodes on its own, so a steady decode step costs the
scheduler almost nothing: it only appends reported tokens, and extends a request's blocks when
its free room falls to the prealloc threshold.

`Scheduler` is the facade over the package's parts, each a class in its own module that adds
methods to the state `placement.Placements` owns:

    placement   placed requests, slots, handles, decode room; the one exit path (`_release`)
    preemption  victims, the admission reserve, pause/resume
    admission   add_request, the step's pieces and their `StepBudget`
    step_plan   the step-cost model and the chunks in flight: per-worker-step token/time limits
    roles       prefill/decode disaggregation: preallocate, add_prefilled, hand-off
    report      apply_report and its tuned hot path
    integrity   check_integrity (tests)
    events      Events and their typed token deltas, SchedulerStats, SchedulerSnapshot

Imported by `kvsched.core.scheduler` (the package) only; imports the parts.
"""

from __future__ import annotations

from typing import Any

from kvsched.core.errors import RequestNotFound
from kvsched.core.kv_events import AllBlocksCleared, KvEvent
from kvsched.core.protocol import FinishReason, Tasks
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.admission import Admission
from kvsched.core.scheduler.events import SchedulerSnapshot
from kvsched.core.scheduler.integrity import check_integrity
from kvsched.core.scheduler.report import Reports


class Scheduler(Reports, Admission):
    """Owns one instance's waiting queue, running set, slots and KV blocks.

    Public calls are synchronous and deterministic; `clock` gives timestamps only.
    `first_handle`: where handle numbers start. A scheduler that replaces another for the same
    instance (its workers reconnected) continues the old numbering, so a message still
    addressed to an old handle can never name a new request.
    """

    def schedule(self) -> Tasks:
        """Plan the next step: block extensions, continuing prefill chunks, new admissions.
        Cost O(requests touched), independent of the number waiting. A message with neither
        a task nor a report to answer has seq 0 and is not meant to be sent; the others are
        numbered 1, 2, 3, ... (the worker's applied_seq names them)."""
        tasks = Tasks(seq=0)  # numbered by _seal if it is to be sent
        if not self.paused:
            budget = self._step_budget()
            self._extend_decoders(tasks, budget)
            self._continue_prefills(tasks, budget)
            if not budget.preempted:
                self._admit(tasks, budget)
                if self.running:
                    self._decay_reserve()
        self._seal(tasks)
        return tasks

    def _seal(self, tasks: Tasks) -> None:
        """Complete the step's Tasks: what was decided outside the step's pieces (preempts and
        aborts go first in the message: their blocks may be reused by the tasks below them),
        the report it answers, and a note for measuring the round trip (`_observe_lag`)."""
        if (self._pending_preempts or self._pending_aborts) and (tasks.extensions or tasks.chunks):
            # A request extended or given a chunk earlier in this step may have been preempted
            # (priority preemption) or ended (a lone request out of room) later in it: drop its
            # tasks, their blocks may be reused.
            gone = {*self._pending_preempts, *self._pending_aborts}
            tasks.extensions = [e for e in tasks.extensions if e.handle not in gone]
            tasks.chunks = [c for c in tasks.chunks if c.handle not in gone]
        host = self.kv.host
        if host is not None and host.has_queued():
            gone_h = {*self._pending_preempts, *self._pending_aborts}
            outs, ins = host.take(gone_h)
            if outs:
                tasks.swap_out_gpu, tasks.swap_out_host = map(list, zip(*outs, strict=True))
            if ins:
                h_, hb_, gb_ = zip(*ins, strict=True)
                tasks.swap_in_handles, tasks.swap_in_host, tasks.swap_in_gpu = (
                    list(h_),
                    list(hb_),
                    list(gb_),
                )
        if self.enc is not None:
            tasks.encoder_drops = self.enc.take_drops()
        tasks.preempts, self._pending_preempts = self._pending_preempts, []
        tasks.aborts, self._pending_aborts = self._pending_aborts, []
        tasks.placements, self._pending_placements = (
            self._pending_placements + tasks.placements,
            [],
        )
        tasks.reset_prefix_cache, self._pending_reset = self._pending_reset, False
        tasks.report_step = max(self._last_step, 0)
        self.stats.num_steps += 1
        empty = tasks.is_empty()
        if empty and self._answered == self._last_step:
            return  # no task and no report to answer: nothing to send (seq 0)
        # Only messages sent are numbered, so a worker sees seq 1, 2, 3, ... without gaps.
        self._seq += 1
        tasks.seq = self._seq
        if host is not None and (tasks.swap_out_gpu or tasks.swap_in_gpu):
            host.sent(self._seq)
        self._answered = self._last_step
        if not empty:  # the report saying it was applied measures the round trip
            self._sent.append((self._seq, self._last_step))
            if len(self._sent) > 4096:  # a worker that never reports applying anything
                self._sent.popleft()

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

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; the worker is told in the next Tasks. Returns the
        number of hashes dropped."""
        n = self.kv.reset_cache()  # both tiers
        for req in self.running.values():
            req.num_cached_blocks = len(req.block_ids)  # do not re-register old content
        if self.enc is not None:  # the worker drops every encoder output with it
            self.enc.reset(self._enc_needed)
        self._pending_reset = True
        return n

    # ==== KV events (docs/CLUSTER.md) ===========================================================
    def enable_kv_events(self) -> None:
        """Record the prefix cache's changes from now on (`take_kv_events` drains them). The
        first event is AllBlocksCleared: a consumer's view of this instance starts empty."""
        if self.kv.pool.events is None:
            self.kv.pool.events = [AllBlocksCleared()]

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events recorded since the last call, oldest first ([] when not enabled)."""
        pool = self.kv.pool
        events = pool.events
        if not events:
            return []
        pool.events = []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (a snapshot for KV-event consumers)."""
        return list(self.kv.pool.cached)

    # ==== introspection =======================================================================
    @property
    def last_tasks_seq(self) -> int:
        return self._seq

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def snapshot(self) -> SchedulerSnapshot:
        """The numbers the daemon's status, admin and metrics show, read at once."""
        kv, st = self.kv, self.stats
        num_slots = self.config.scheduler.max_num_seqs
        # A preempted request counts as running until its worker acknowledges the preempt:
        # tokens it reports before that are still streamed (O(live): status reads only).
        preempting = sum(1 for r in self.live.values() if r.status == RequestStatus.PREEMPTED)
        return SchedulerSnapshot(
            num_waiting=len(self.waiting),
            num_running=len(self.running) + preempting,
            num_slots=num_slots,
            num_slots_used=num_slots - len(self.free_slots),
            num_gpu_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_steps=st.num_steps,
            num_preemptions=st.num_preemptions,
            num_preemption_skips=st.num_preemption_skips,
            num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=st.num_generation_tokens,
            prefix_cache_query_tokens=kv.num_queries,
            prefix_cache_hit_tokens=kv.num_hits,
            paused=self.paused,
            decode_headroom=self._threshold,
            reserve_blocks_per_running=self.reserve_blocks_per_running,
            last_report_step=self._last_step,
            last_tasks_seq=self._seq,
            **self._step_cost_view(),
            **self._host_view(),
            **self._encoder_view(),
        )

    def _encoder_view(self) -> dict[str, Any]:
        enc = self.enc
        if enc is None:
            return {}
        st = enc.stats
        return {
            "encoder_cache_size": enc.capacity,
            "encoder_cache_used": enc.used,
            "encoder_cache_hits": st.hits,
            "encoder_cache_misses": st.misses,
            "encoder_cache_evictions": st.evictions,
        }

    def _host_view(self) -> dict[str, Any]:
        kv, host = self.kv, self.kv.host
        if host is None:
            return {}
        st = host.stats
        return {
            "num_host_blocks": host.num_blocks,
            "num_free_host_blocks": host.num_free,
            "host_cache_usage": host.pool.usage,
            "prefix_cache_host_hit_tokens": kv.num_host_hits,
            "num_swap_outs": st.swap_outs,
            "num_swap_ins": st.swap_ins,
            "num_swap_failures": st.swap_out_failures + st.swap_in_failures,
            "num_swap_ins_declined": st.swap_ins_declined,
        }

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
        if self.kv.host is not None:  # the run continues in host memory (swapped in)
            n += len(self.kv.host.run_from(req.block_hashes[n:]))
        return n * self.block_size

    def check_integrity(self) -> None:
        """Assert every invariant of the scheduler's state (O(everything): tests only)."""
        check_integrity(self)
