"""The backlog of one instance: its waiting queue, TTFT deadlines, tenants' served tokens and
shedding (scheduling rule 12 in docs/ARCHITECTURE.md).

- A request's deadline is absolute on the scheduler's clock: arrival + its `ttft_deadline_ms`,
  or + `fairness.default_ttft_deadline_ms` when it names none (an implicit deadline: such
  requests age and keep arrival order among themselves).
- Queued work is kept in predicted milliseconds of prefill (the step-cost model's prefill
  terms over the tokens not cached): `queued_ms` of each waiting request (the queue sums
  them) and `_prefill_backlog_ms` of the prompts admitted and not fully sent. The router reads
  the sum (`queued_prefill_ms`), shedding the part ahead of a new request.
- Shedding (`fairness.shed`): a request with a deadline of its own whose predicted time to
  first token (prefill queued ahead of it in its class and above, plus its own, stretched by
  the share of each step the decodes leave to prefill) passes its deadline is rejected with
  CapacityExceeded before anything changes ("shed"), or queued in a lower class ("demote").
- Order of the admitted prompts while the time target binds (`prefill_order`): priority
  class; then prompts whose deadline has passed, earliest first (aging: a long prompt is not
  overtaken by shorter ones for ever); then the least prefill left.
- Served tokens per tenant (`kvsched.core.fairness.TenantCounters`): prompt tokens when their
  chunk is sent, output tokens on the report visits of a request and when it leaves its slot.

`Backlog` owns the queue (built once, over the tenants' counters), the counters, the prefill
backlog and the shed/demote counts; it reads the placement table and the step plan, and queues a new request (`add`: validated,
stamped, shed or demoted, tracked). Imports `table`, `step_plan` and `validation`.
"""

from __future__ import annotations

from collections.abc import Callable

import kvsched.core.lifecycle as lifecycle
from kvsched.core.config import EngineConfig, QueuePolicy, ShedPolicy
from kvsched.core.errors import CapacityExceeded
from kvsched.core.fairness import TenantCounters, make_queue
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.request import Request
from kvsched.core.scheduler.step_plan import StepPlan
from kvsched.core.scheduler.table import Freed, PlacementTable
from kvsched.core.scheduler.validation import validate

# Below this share of a step left to prefill by the decodes, the wait is predicted at it
# (the min_prefill_chunk floor keeps prompts moving however full the decodes are).
_MIN_PREFILL_SHARE = 0.1


class Backlog:
    """Owns the waiting queue, the tenants' counters, the prefill backlog and shedding."""

    def __init__(
        self,
        config: EngineConfig,
        table: PlacementTable,
        plan: StepPlan,
        kv: KVCacheManager,
        clock: Callable[[], float],
        instance_id: str = "",
    ) -> None:
        self._table, self._plan, self._kv = table, plan, kv
        self._config, self._clock, self._instance_id = config, clock, instance_id
        self._spec_k = config.speculative.num_speculative_tokens
        self.tenants = TenantCounters(config.fairness)
        self.waiting = make_queue(config.scheduler.policy, self.tenants)
        self._prefill_backlog_ms = 0.0  # predicted prefill ms of admitted prompts not yet sent
        self.num_shed = 0
        self.num_demoted = 0

    # ==== the queue ===========================================================================
    def add(self, req: Request, queued: bool = True, num_held: int = 0) -> None:
        """A new request, validated, stamped, checked against its deadline, tracked and queued
        (not `queued`: held by its sample group, `groups.py`, until `release_held`; `num_held`
        such samples wait already and count against max_waiting). Raises InvalidRequest (bad
        fields, duplicate id) or CapacityExceeded (the queue is at max_waiting, or it is
        shed); state is unchanged when it raises."""
        table, sc = self._table, self._config.scheduler
        validate(req, self._config, table.requests, self._kv.pool.num_blocks)
        if len(self.waiting) + num_held >= sc.max_waiting:
            raise CapacityExceeded(
                f"waiting queue is full ({sc.max_waiting} requests); "
                "retry later or raise scheduler.max_waiting"
            )
        lifecycle.queue(req, self._clock())
        self.check_deadline(req, shared=not queued)  # may shed it (CapacityExceeded) or demote it
        table.track(req)
        if queued:
            self.push(req)

    def push(self, req: Request) -> None:
        self.waiting.push(req)

    def release_held(self, req: Request) -> None:
        """A sample its group held (`groups.py`) joins the queue's front: its prompt's full
        blocks are cached now, so its queued work is the tail."""
        req.queued_ms = self.predicted_prefill_ms(req, self._kv.hit_tokens(req))
        self.waiting.push_front(req)

    def push_front(self, req: Request) -> None:
        """A preempted request the worker acknowledged: waiting again, at the queue's front."""
        self.waiting.push_front(req)

    def pop_head(self) -> None:
        self.waiting.pop()

    def skip_head(self) -> Request:
        """Take the queue's head out for this admission pass (it may not run now: its LoRA
        adapter would exceed max_loras); `restore_skipped` puts it back."""
        return self.waiting.pop()

    def restore_skipped(self, skipped: list[Request]) -> None:
        """The heads `skip_head` took, back at the queue's front in their order."""
        for req in reversed(skipped):
            self.waiting.push_front(req)

    def discard(self, req: Request) -> None:
        self.waiting.discard(req)

    # ==== predictions =========================================================================
    def _prefill_ms(self, start: int, end: int) -> float:
        """Predicted GPU milliseconds of prefill positions [start, end) in chunks: the token
        term plus the attention term summed over the chunks, ~ (end^2 - start^2) / 2."""
        if end <= start:
            return 0.0
        a_tok, a_attn = self._plan.cost.prefill_costs
        return a_tok * (end - start) + a_attn * (end * end - start * start) / 2

    @property
    def queued_prefill_ms(self) -> float:
        """Predicted prefill milliseconds queued on this instance (waiting + being prefilled)."""
        return self.waiting.queued_ms + self._prefill_backlog_ms

    def predicted_backlog_ms(self) -> float:
        """Predicted milliseconds until this instance has sent every queued prompt's prefill:
        the queued prefill at the share of each step the decodes leave it (for routing)."""
        return self.queued_prefill_ms / self._prefill_share()

    def drain_claim_ms(self) -> float:
        """The waiting and prefilling prompts' claim on the coming steps (`StepPlan.
        step_target_ms`): their queued prefill, each prompt counted up to one floor chunk
        (min_prefill_chunk tokens), by their mean: many short prompts claim all of theirs, one
        long prompt one chunk (it still runs in chunks under the target); less one prompt's
        share, the one the floor serves each step anyway (one prompt alone stretches nothing;
        two claim half of theirs). Waiting prompts count only while the queue's head could be
        placed (a free slot, free blocks for its whole prompt beside the admitted prompts'):
        longer steps would not admit them."""
        table, waiting = self._table, self._waiting_admissible()
        n = waiting + len(table.prefilling)
        if n < 2:
            return 0.0
        queued = self._prefill_backlog_ms + (self.waiting.queued_ms if waiting else 0.0)
        return min(queued, n * self._plan.floor_ms) * (n - 1) / n

    def _waiting_admissible(self) -> int:
        """How many waiting prompts could start now, judged by the head alone (O(1))."""
        table, waiting = self._table, self.waiting
        if not waiting or not table.free_slots:
            return 0
        head = waiting.peek()
        if head is None:
            return 0
        blocks = -(-head.num_tokens // table.block_size)
        if blocks + table.prefill_debt > self._kv.num_free_blocks:
            return 0
        return min(len(waiting), len(table.free_slots))

    def _prefill_share(self) -> float:
        """The share of a worker step the decodes leave to prefill under the step target."""
        plan = self._plan
        d = self._table.num_decoding
        if plan.itl_target_ms <= 0 or d <= 0:
            return 1.0
        decode_ms = plan.cost.predict_ms(d * self._spec_k, d, plan.decode_ctx, 0)
        target = plan.step_target_ms(decode_ms, self.drain_claim_ms())
        return max(_MIN_PREFILL_SHARE, 1.0 - decode_ms / target)

    def predicted_prefill_ms(self, req: Request, num_hit: int) -> float:
        """Predicted prefill milliseconds of req's prompt here with num_hit tokens cached."""
        return self._prefill_ms(min(num_hit, req.num_tokens - 1), req.num_tokens)

    def predicted_wait_ms(self, req: Request, hit_tokens: int | None = None) -> float:
        """Predicted milliseconds from now to req's first token if it were queued now: with
        its own `queued_ms`, or (routing: req not queued here) with hit_tokens cached here."""
        own = req.queued_ms if hit_tokens is None else self.predicted_prefill_ms(req, hit_tokens)
        ahead = self.waiting.ms_ahead(req) + self._prefill_backlog_ms
        return (ahead + own) / self._prefill_share()

    # ==== admission's side ====================================================================
    def check_deadline(self, req: Request, shared: bool = False) -> None:
        """A new request (validated, arrival set): its deadline, its queued work, and the shed
        policy (`shared`: a sample held for its group's prompt, groups.py: its work is the
        tail after the prompt's full blocks). Raises CapacityExceeded (state unchanged) when
        it is shed."""
        fc = self._config.fairness
        own = req.ttft_deadline_ms
        req.deadline = req.arrival_time + (own or fc.default_ttft_deadline_ms) / 1e3
        bs = self._table.block_size
        hit = (req.num_tokens - 1) // bs * bs if shared else self._kv.hit_tokens(req)
        req.queued_ms = self.predicted_prefill_ms(req, hit)
        if not own or fc.shed == ShedPolicy.OFF:
            return
        wait_ms = self.predicted_wait_ms(req)
        left_ms = (req.deadline - self._clock()) * 1e3
        if wait_ms <= left_ms:
            return
        shed = self.tenants.shed
        shed[req.tenant] = shed.get(req.tenant, 0) + 1
        if fc.shed == ShedPolicy.SHED:
            self.num_shed += 1
            raise CapacityExceeded(
                f"request {req.req_id!r}: predicted time to first token {wait_ms:,.0f} ms "
                f"(prefill queued ahead on instance {self._instance_id or '-'}) exceeds its "
                f"ttft_deadline_ms {own:,.0f}; retry later, elsewhere, or with a later deadline"
            )
        lifecycle.demote(req)
        self.num_demoted += 1

    def on_admitted(self, req: Request, num_hit: int) -> None:
        """req left the queue for a slot, num_hit prompt tokens cached: its prefill is now
        the instance's backlog."""
        req.queued_ms = self._prefill_ms(num_hit, req.num_tokens)
        self._prefill_backlog_ms += req.queued_ms

    def on_chunk(self, req: Request, start: int, n: int) -> None:
        """A chunk of n prompt tokens from `start` was sent: charge its tenant, shrink the
        backlog."""
        self.tenants.charge(req.tenant, n)
        done = req.num_computed_tokens >= req.num_prefill_tokens
        ms = req.queued_ms if done else min(req.queued_ms, self._prefill_ms(start, start + n))
        req.queued_ms -= ms
        left = self._prefill_backlog_ms - ms
        self._prefill_backlog_ms = max(0.0, left) if self._table.prefilling else 0.0

    def charge_output(self, req: Request) -> None:
        """Charge req's tenant for the output tokens reported since the last charge."""
        n = len(req.output_token_ids) - req.charged_output
        if n > 0:
            req.charged_output += n
            self.tenants.charge(req.tenant, 0, n)

    def released(self, req: Request, freed: Freed) -> None:
        """req left its slot (`PlacementTable.release` freed `freed`): its prefill is no longer
        queued here, and its tenant is charged for the output it made."""
        if freed.was_prefilling:
            self._prefill_backlog_ms = max(0.0, self._prefill_backlog_ms - req.queued_ms)
        req.queued_ms = 0.0  # requeued after a preempt: counted as no queued work
        self.charge_output(req)

    def prefill_order(self, continuing: list[Request]) -> list[Request]:
        """The admitted prompts in the order their next chunks are sized while the time
        target binds: class; then (under the `slo` policy) the tenant with the fewest weighted
        served tokens, as for admission; then prompts with a deadline of their own not yet
        passed, earliest first; then prompts past their implicit deadline, earliest first
        (aging: a long prompt is not overtaken by shorter ones for ever); then the least
        prefill left. A prompt past a deadline of its own has missed it: it goes by prefill
        left, behind those that can still make theirs."""
        now = self._clock()
        policy = self._config.scheduler.policy
        fcfs, slo = policy == QueuePolicy.FCFS, policy == QueuePolicy.SLO
        counter = self.tenants.counter

        def key(r: Request) -> tuple[bool, int, float, int, float]:
            cls = 0 if fcfs else r.priority
            share = counter(r.tenant) if slo else 0.0
            if r.deadline > now:
                if r.ttft_deadline_ms:
                    return (r.demoted, cls, share, 0, r.deadline)
            elif not r.ttft_deadline_ms:
                return (r.demoted, cls, share, 1, r.deadline)
            return (r.demoted, cls, share, 2, r.num_prefill_tokens - r.num_computed_tokens)

        return sorted(continuing, key=key)
