"""The scheduler an instance's ranks make when its last rank has joined: the instance's config
with the sizes their Hellos announced (every rank says the same: `ranks.check_joining_rank`),
the daemon's storage tier only when every rank reaches the store, and ProtocolError naming the
instance when those sizes do not fit its config. Its step-cost model starts from a fit learned
already when there is one (`learned_cost`: the instance's previous scheduler's, or a sibling
instance's of the same model, `InstanceEngine.cost_seed`), not from the config's seed: an
instance whose workers just moved here is priced at the speed seen, not at the default GPU's
(a takeover's adopted requests are spread by that price the moment it joins).

Builds a Scheduler and hands it to the engine (`engine._start`), the only module that keeps
and reads one; imports only `ranks` and core.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from kvsched.core import ConfigError, EngineConfig, ProtocolError, Scheduler, StorageIndex
from kvsched.server.instances.ranks import RankConn

log = logging.getLogger("kvsched.engine")

# A scheduler's fit is handed on (`learned_cost`) once it has learned from this many steps.
LEARNED_AFTER = 8


def instance_config(engine_config: EngineConfig, first: RankConn, limits: Any) -> EngineConfig:
    """A copy of the instance's config with the sizes its ranks announced, slots capped by the
    worker's, and max_model_len from `limits` (server.models.Limits: the smaller of the
    daemon's and the worker's; None: as configured)."""
    cfg = copy.deepcopy(engine_config)
    cfg.cache.block_size = first.block_size
    cfg.cache.num_gpu_blocks = first.num_gpu_blocks  # every rank says the same (attach)
    cfg.cache.num_host_blocks = first.num_host_blocks
    cfg.scheduler.max_num_seqs = min(cfg.scheduler.max_num_seqs, first.num_slots)
    if limits is not None:
        cfg.scheduler.max_model_len = limits.max_model_len
    return cfg


def learned_cost(sched: Scheduler, min_reports: int = LEARNED_AFTER) -> tuple[float, ...] | None:
    """The step-cost coefficients `sched` has learned (FEATURES order, none below 0), or None
    when it has learned from fewer than `min_reports` steps (its seed would say as much)."""
    model = sched.cost
    if model.num_observed < min_reports:
        return None
    return tuple(max(0.0, c) for c in model.coefficients)


def seed_cost(cfg: EngineConfig, coefficients: tuple[float, ...]) -> None:
    """Make `coefficients` (FEATURES order) `cfg`'s step-cost seed."""
    sc = cfg.step_cost
    (
        sc.intercept_ms,
        sc.per_prefill_token_ms,
        sc.per_decode_ms,
        sc.per_decode_context_ms,
        sc.per_attention_ms,
        sc.per_swapped_block_ms,
        sc.per_fetched_block_ms,
    ) = coefficients


def start_scheduler(
    instance_id: str,
    engine_config: EngineConfig,
    conns: list[RankConn],
    limits: Any,
    storage: tuple[StorageIndex | None, str],
    first_handle: int,
    cost_seed: tuple[float, ...] | None = None,
) -> Scheduler:
    """The instance's new Scheduler over all its ranks `conns`; `storage`: the daemon's shared
    index and its backend kind (None: no storage tier); `first_handle`: where its handles
    continue; `cost_seed`: step-cost coefficients learned already (`learned_cost`), which its
    step-cost model starts from instead of the config's seed. Raises ProtocolError when the
    ranks' sizes do not fit the config."""
    cfg = instance_config(engine_config, conns[0], limits)
    if cost_seed is not None:
        seed_cost(cfg, cost_seed)
    index, kind = storage
    if index is not None and not all(kind in c.storage_backends for c in conns):
        index = None  # a rank cannot reach the store: no storage tasks to this instance
    try:
        sched = Scheduler(
            cfg,
            clock=time.monotonic,
            instance_id=instance_id,
            first_handle=first_handle,
            storage=index,
            storage_namespace=limits.model if limits else conns[0].model,
        )
    except ConfigError as exc:  # the workers' sizes do not fit this instance's config
        raise ProtocolError(f"instance {instance_id!r} cannot start: {exc}") from None
    log.info(
        "instance %s ready: %d rank(s), %d blocks of %d tokens, %d slots, role %s",
        instance_id,
        len(conns),
        cfg.cache.num_gpu_blocks,
        cfg.cache.block_size,
        cfg.scheduler.max_num_seqs,
        cfg.role.value,
    )
    return sched
