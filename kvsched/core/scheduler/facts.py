"""What a scheduler shows others, read off its parts and never written: the snapshot the
daemon's status, admin and metrics read, the load facts an instance's load is computed from
and a cluster publishes, and the routing price of a request's cached prefix.

Imported by the scheduler facade only.
"""

from __future__ import annotations

from kvsched.core.config import EngineConfig
from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.request import Request, RequestStatus
from kvsched.core.scheduler.backlog import Backlog
from kvsched.core.scheduler.events import LoraState, SchedulerSnapshot, SchedulerStats
from kvsched.core.scheduler.exits import Exits
from kvsched.core.scheduler.groups import SampleGroups
from kvsched.core.scheduler.outbox import Outbox
from kvsched.core.scheduler.report import ReportApplier
from kvsched.core.scheduler.step_plan import StepPlan
from kvsched.core.scheduler.table import PlacementTable
from kvsched.core.scheduler.views import cache_views


class Facts:
    """Read-only views over the scheduler's parts (handed in at construction)."""

    def __init__(
        self,
        config: EngineConfig,
        table: PlacementTable,
        kv: KVCacheManager,
        enc: EncoderCache | None,
        plan: StepPlan,
        backlog: Backlog,
        exits: Exits,
        outbox: Outbox,
        reports: ReportApplier,
        stats: SchedulerStats,
        groups: SampleGroups,
    ) -> None:
        self.config, self.table, self.kv, self.enc = config, table, kv, enc
        self.plan, self.backlog, self.exits, self.outbox = plan, backlog, exits, outbox
        self.reports, self.stats, self.groups = reports, stats, groups

    def snapshot(self) -> SchedulerSnapshot:
        """The numbers the daemon's status, admin and metrics show, read at once."""
        kv, st = self.kv, self.stats
        table = self.table
        num_slots = self.config.scheduler.max_num_seqs
        # A preempted request counts as running until its worker acknowledges the preempt:
        # tokens it reports before that are still streamed (O(live): status reads only).
        preempting = sum(1 for r in table.live.values() if r.status == RequestStatus.PREEMPTED)
        return SchedulerSnapshot(
            # Samples held for their group's prompt (groups.py) wait too, outside the queue.
            num_waiting=len(self.backlog.waiting) + self.groups.num_held,
            num_running=len(table.running) + preempting,
            num_slots=num_slots,
            num_slots_used=num_slots - len(table.free_slots),
            num_gpu_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_steps=st.num_steps,
            num_preemptions=st.num_preemptions,
            num_preemption_skips=st.num_preemption_skips,
            num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=st.num_generation_tokens,
            num_draft_tokens=st.num_draft_tokens,
            num_accepted_drafts=st.num_accepted_drafts,
            prefix_cache_query_tokens=kv.num_queries,
            prefix_cache_hit_tokens=kv.num_hits,
            paused=self.exits.paused,
            decode_headroom=self.outbox.threshold,
            reserve_blocks_per_running=self.exits.reserve_blocks_per_running,
            last_report_step=self.reports.last_report_step,
            last_tasks_seq=self.outbox.seq,
            **self.plan.view(),
            **cache_views(self.kv, self.enc),
        )

    def lora_state(self) -> LoraState:
        """The adapters running and queued here now (copies), with the max_loras limit."""
        return LoraState(
            self.config.scheduler.max_loras,
            dict(self.table.loras),
            dict(self.backlog.waiting.loras),
        )

    def lora_affinity(self, req: Request) -> int:
        """How well req's LoRA adapter fits here (llm-d's order): 2 loaded (requests of it run,
        wait, or are held for a hand-off here), 1 a free adapter slot (fewer than max_loras
        adapters in use), 0 neither (it would queue behind other adapters); 0 for no adapter."""
        name = req.lora_name
        if not name:
            return 0
        running, waiting = self.table.loras, self.backlog.waiting.loras
        held = self.table.held_loras() if self.table.reserved else set()
        if name in running or name in waiting or name in held:
            return 2
        max_loras = self.config.scheduler.max_loras
        if not max_loras or len(running.keys() | waiting.keys() | held) < max_loras:
            return 1
        return 0

    def load_facts(self, queued: bool = False) -> dict[str, float]:
        """The numbers an instance's load is computed from (`kvsched.core.router.instance_load`)
        and a cluster publishes; `queued`: with the prompt tokens waiting (O(waiting))."""
        facts = {
            "running": float(len(self.table.running)),
            "waiting": float(len(self.backlog.waiting)),
            "max_num_seqs": float(self.config.scheduler.max_num_seqs),
            "kv_usage": self.kv.usage,
        }
        if queued:
            waiting = self.backlog.waiting
            facts["queued_prefill_tokens"] = float(
                sum(req.num_tokens - req.num_computed_tokens for req in waiting)
            )
        facts["predicted_backlog_ms"] = self.backlog.predicted_backlog_ms()
        return facts

    def published_load(self) -> dict[str, float]:
        """The load facts a cluster publishes (with the queued prompt tokens; rounded)."""
        facts = self.load_facts(queued=True)
        facts["kv_usage"] = round(facts["kv_usage"], 4)
        facts["predicted_backlog_ms"] = round(facts["predicted_backlog_ms"], 3)
        # The step-cost model peers price this instance's hits with (recompute vs swap-in).
        cost = self.plan.cost
        facts["prefill_token_ms"], facts["attention_ms"] = cost.prefill_costs
        facts["swap_block_ms"] = cost.swap_block_ms
        if self.kv.storage is not None:
            facts["fetch_block_ms"] = cost.fetch_block_ms
        return facts

    def priced_hit(self, req: Request) -> tuple[float, int]:
        """(tokens req's hit is worth here, tokens cached in any tier): GPU hits whole, host
        hits by the share of their recompute time a swap-in saves, storage hits likewise by
        a fetch's (`priced_hit_tokens`)."""
        gpu, host, stored = self.kv.tier_hits(req)
        worth = self.plan.cost.priced_tier_hit(gpu, host, stored, self.kv.block_size)
        return worth, gpu + host + stored

    def host_block_hashes(self) -> list[bytes]:
        """Every hash the host-memory tier holds now ([] without one)."""
        host = self.kv.host
        return list(host.pool.cached) if host is not None else []
