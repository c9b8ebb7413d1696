"""What bench.peers holds equal to compare schedulers alone: placements and arrivals.

- Placements. `routed`: each scheduler behind its own router (kvsched's Router over kvsched's
  state; vLLM's instances scored by the same formula over vLLM's state, bench/vllm_adapter.py).
  `pinned`: both schedulers serve the SAME per-request placement, the one kvsched's router made
  in its routed run (recorded from rec.instance); `pinned-vllm`: the one vLLM's made. `rr`: both round-robin (request i on instance
  i mod N, blind to everything). `single`: one instance, no routing at all, at the same load per
  instance (arrivals slowed N times).
- Arrivals. A trace's own timestamps (scaled by --rate-scale), or Poisson arrivals at a given
  rate over the trace's lengths (`poisson`), with the rate set from a measured capacity
  (`capacity_rps`: every request at t = 0, completed requests over the last finish time).

kvsched never imports this module (bench only); it imports vLLM only through bench.vllm_adapter,
and only when a vLLM cluster is built.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.simulate import EventLoop, KvschedCluster, SimResult
from bench.vllm_adapter import VllmBuilder, VllmCluster
from kvsched.core import EngineConfig, Request, Scheduler
from kvsched.core.step_cost import FEATURES
from kvsched.traces import TraceRequest
from kvsched.worker_stub.costmodel import fit_for

MODES = ("routed", "pinned", "pinned-vllm", "rr", "single")


def request_index(req_id: str) -> int:
    """bench.simulate names request i "r{i}"."""
    return int(req_id[1:])


class FixedRouter:
    """Stands in for kvsched's Router: the instance is looked up, never chosen. The scheduler
    hashes the prompt's blocks itself (as it does with one instance, where no router runs)."""

    def __init__(self, placement: Sequence[int]) -> None:
        self.placement = placement

    def pick(self, scheds: Sequence[Scheduler], req: Request) -> int:
        return self.placement[request_index(req.req_id)]


class PinnedVllmCluster(VllmCluster):
    """vLLM's scheduler on N instances with a given placement."""

    def __init__(self, *args: Any, placement: Sequence[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.placement = placement

    def _pick(self, vreq: Any) -> int:
        return self.placement[request_index(vreq.request_id)]


def round_robin(num_requests: int, num_instances: int) -> list[int]:
    return [i % num_instances for i in range(num_requests)]


def recorded_placement(result: SimResult) -> list[int]:
    """Where a routed run put each request (0 for one it rejected before routing)."""
    return [rec.instance if rec.instance is not None else 0 for rec in result.records]


def kvsched_factory(
    config: EngineConfig,
    instances: int,
    gpu: str,
    control_latency_s: float,
    name: str,
    placement: Sequence[int] | None = None,
    model_log: list[dict[str, float]] | None = None,
    model_every_s: float = 30.0,
) -> Callable[[EventLoop], KvschedCluster]:
    """model_log: filled with the step-cost model against the sim's fit every model_every_s
    of virtual time (`model_sample`), while the run has events left."""

    def make(loop: EventLoop) -> KvschedCluster:
        cluster = KvschedCluster(
            loop,
            copy.deepcopy(config),
            num_instances=instances,
            gpu=gpu,
            control_latency_s=control_latency_s,
            name=name,
        )
        if placement is not None:
            cluster.router = FixedRouter(placement)  # type: ignore[assignment]
        if model_log is not None:

            def sample() -> None:
                model_log.append(model_sample(cluster, loop.now, gpu))
                if loop._heap:  # something else is still to happen
                    loop.at(loop.now + model_every_s, sample)

            loop.at(0.0, sample)
        return cluster

    return make


def vllm_factory(
    builder: VllmBuilder,
    instances: int,
    gpu: str,
    name: str,
    placement: Sequence[int] | None = None,
) -> Callable[[EventLoop], VllmCluster]:
    if placement is None:
        return lambda loop: VllmCluster(loop, builder, instances, gpu, name=name)
    return lambda loop: PinnedVllmCluster(
        loop, builder, instances, gpu, name=name, placement=placement
    )


# ---- arrivals ---------------------------------------------------------------------------------
def poisson(requests: Sequence[TraceRequest], rate_rps: float, seed: int = 0) -> list[TraceRequest]:
    """The same requests (lengths, tokens, order) arriving as a Poisson process of rate_rps."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be > 0, got {rate_rps}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_rps, len(requests))
    times = np.cumsum(gaps) - gaps[0]
    return [
        dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, times, strict=True)
    ]


def burst(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Every request at t = 0."""
    return [dataclasses.replace(r, arrival_s=0.0) for r in requests]


def capacity_rps(result: SimResult) -> float:
    """Completed requests per second of a burst run: its saturated throughput."""
    ends = [r.finish_s for r in result.records if r.finish_s is not None]
    served = sum(1 for r in result.records if r.finish_reason not in (None, "rejected"))
    return served / max(ends) if ends else 0.0


# ---- the step-cost model against the sim's fit ------------------------------------------------
_TERMS = ("prefill_tokens", "decode_context", "attention")


def _true_ms(gpu: str) -> dict[str, float]:
    fit = fit_for(gpu)
    return {
        "prefill_tokens": fit.per_token_ms,
        "decode_context": fit.per_ctx_ms,
        "attention": fit.per_attn_ms,
    }


def model_sample(cluster: KvschedCluster, now: float, gpu: str) -> dict[str, float]:
    """Learned / true per term (mean over instances) and reports learned, at virtual time now."""
    costs = [inst.sched.cost for inst in cluster.instances]
    true = _true_ms(gpu)
    row = {"t_s": now, "steps_learned": float(sum(c.num_observed for c in costs))}
    for term in _TERMS:
        i = FEATURES.index(term)
        row[term] = float(np.mean([c.coefficients[i] for c in costs])) / true[term]
    return row


def model_vs_fit(summary: dict[str, Any], gpu: str) -> dict[str, Any] | None:
    """Learned / true for the terms the sim's fit has (mean over instances): 1.0 is converged.
    None for a scheduler without a model (vLLM)."""
    models = [m for m in summary.get("cost_models") or [] if m]
    if not models:
        return None
    true = _true_ms(gpu)
    out: dict[str, Any] = {}
    for term, value in true.items():
        i = FEATURES.index(term)
        out[term] = float(np.mean([m["coefficients_ms"][i] for m in models])) / value
    out["predicted_over_measured"] = float(
        np.mean(
            [
                m["ewma_predicted_ms"] / m["ewma_measured_ms"]
                for m in models
                if m["ewma_measured_ms"]
            ]
        )
    )
    out["steps_learned"] = int(sum(m["steps_learned"] for m in models))
    return out
