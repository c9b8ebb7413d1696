"""What a simulated run returns (bench/simulate.py): each instance's accounting
(`InstanceStats`) and the run's result (`SimResult`: the requests' records and the summaries
built from them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsched.replay.summary import (
    DEFAULT_SLO_TPOT_S,
    DEFAULT_SLO_TTFT_S,
    RequestRecord,
    percentile,
    summarize,
)


@dataclass(slots=True)
class InstanceStats:
    """One instance's worker and scheduler accounting."""

    num_steps: int = 0
    busy_s: float = 0.0  # virtual time spent in steps
    idle_s: float = 0.0  # virtual time idle between its first and last step
    # Idle while Tasks the daemon had already produced were on their way (control_latency_s):
    # the worker had work, but waited on the control plane.
    idle_control_plane_s: float = 0.0
    num_preemptions: int = 0
    sched_ns: list[int] = field(default_factory=list)  # real CPU per daemon step (wake)
    # Per executed worker step: prompt tokens of its prefill chunks, and its time (seconds).
    prefill_tokens: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    # The daemon's step-cost model at the end: coefficients (ms per unit, in
    # kvsched.core.step_cost.FEATURES order), and its last one-step-ahead predicted / measured
    # moving averages (ms). Empty for schedulers without one.
    cost_model: dict[str, Any] = field(default_factory=dict)
    # The host tier's figures at the end (empty without one): blocks, tokens looked up / hit in
    # either tier / hit in host memory, blocks copied each way.
    host: dict[str, Any] = field(default_factory=dict)
    # The storage tier's figures at the end (empty without one): tokens fetched as prefix hits,
    # blocks written / fetched, failures, fetches declined by the cost model.
    storage: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimResult:
    name: str
    records: list[RequestRecord]
    instances: list[InstanceStats]
    num_gpu_blocks: int
    block_size: int
    router_ns: list[int]
    wall_s: float  # real time the simulation took

    @property
    def num_steps(self) -> int:
        return sum(s.num_steps for s in self.instances)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.instances)

    def summary(
        self, slo_ttft_s: float = DEFAULT_SLO_TTFT_S, slo_tpot_s: float = DEFAULT_SLO_TPOT_S
    ) -> dict[str, Any]:
        """`kvsched.replay.summary.summarize` plus the simulator's own fields."""
        out = summarize(
            self.records,
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            preemptions=self.num_preemptions,
            slo_ttft_s=slo_ttft_s,
            slo_tpot_s=slo_tpot_s,
        )
        span = out["duration_s"] * len(self.instances)
        ns = sorted(x for s in self.instances for x in s.sched_ns)
        steps = self.num_steps
        out.update(
            name=self.name,
            instances=len(self.instances),
            steps=steps,
            worker_busy_frac=sum(s.busy_s for s in self.instances) / span if span else 0.0,
            worker_idle_s=sum(s.idle_s for s in self.instances),
            worker_idle_frac_control_plane=(
                sum(s.idle_control_plane_s for s in self.instances) / span if span else 0.0
            ),
            rejected=sum(1 for r in self.records if r.finish_reason == "rejected"),
            # Real CPU of the scheduler: mean per worker step (every call, arrivals' included,
            # over steps) and the distribution over calls (one report + one schedule each).
            scheduler_cpu_us_per_step={
                "mean": sum(ns) / steps / 1e3 if steps else None,
                "p50": _pct_us(ns, 50),
                "p99": _pct_us(ns, 99),
            },
            scheduler_calls=len(ns),
            # What each executed worker step held: prompt tokens of its chunks (the token
            # budget's bound) and its time by the cost model.
            prefill_tokens_per_step=_dist(
                sorted(x for st in self.instances for x in st.prefill_tokens if x)
            ),
            step_time_s=_dist(sorted(x for st in self.instances for x in st.step_s)),
            cost_models=[st.cost_model for st in self.instances],
            **_host_summary(self.instances, out["prompt_tokens"]),
            **_storage_summary(self.instances, out["prompt_tokens"]),
            router_us_per_request=(
                sum(self.router_ns) / len(self.router_ns) / 1e3 if self.router_ns else None
            ),
            sim_wall_s=self.wall_s,
        )
        return out


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 / max of sorted values (None when there are none)."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": values[-1]}


def _host_summary(instances: list[InstanceStats], prompt_tokens: int) -> dict[str, Any]:
    """num_host_blocks (per instance) and host_hit_rate (prompt tokens swapped in from host
    memory over prompt tokens, as prefix_hit_rate), and the copies, summed over instances."""
    hosts = [st.host for st in instances if st.host]
    if not hosts:
        return {"num_host_blocks": 0, "host_hit_rate": 0.0}
    host_hits = sum(h["host_hit_tokens"] for h in hosts)
    return {
        "num_host_blocks": hosts[0]["num_host_blocks"],
        "host_hit_rate": host_hits / prompt_tokens if prompt_tokens else 0.0,
        "swap_outs": sum(h["swap_outs"] for h in hosts),
        "swap_ins": sum(h["swap_ins"] for h in hosts),
        "swap_ins_declined": sum(h["swap_ins_declined"] for h in hosts),
    }


def _storage_summary(instances: list[InstanceStats], prompt_tokens: int) -> dict[str, Any]:
    """storage_hit_rate (prompt tokens fetched from the storage tier over prompt tokens) and
    its tasks, summed over instances ({} without a storage tier)."""
    st = [s.storage for s in instances if s.storage]
    if not st:
        return {}
    hits = sum(s["storage_hit_tokens"] for s in st)
    out: dict[str, Any] = {"storage_hit_rate": hits / prompt_tokens if prompt_tokens else 0.0}
    for k in ("writes", "fetches", "write_failures", "fetch_failures", "fetches_declined"):
        out[f"storage_{k}"] = sum(s[k] for s in st)
    return out


def _pct_us(sorted_ns: list[int], p: float) -> float | None:
    return percentile(sorted_ns, p) / 1e3 if sorted_ns else None
