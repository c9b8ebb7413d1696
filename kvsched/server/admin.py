"""AdminService: status of instances, queues and KV usage; drain; pause / resume; reset cache."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kvsched import codec
from kvsched.server.instances.engine import InstanceEngine
from kvsched.server.instances.registry import InstanceRegistry
from kvsched.server.requests.table import RequestTable
from kvsched.v1 import admin_service_pb2 as apb
from kvsched.v1 import admin_service_pb2_grpc

# InstanceStatus fields copied as they are from the scheduler's snapshot (same names).
_FROM_SNAPSHOT = (
    "paused",
    "num_slots",
    "num_slots_used",
    "num_gpu_blocks",
    "num_free_blocks",
    "kv_cache_usage",
    "num_waiting",
    "num_running",
    "num_steps",
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
    "num_preemptions",
    "num_draft_tokens",
    "num_accepted_drafts",
    "step_predicted_ms",
    "step_measured_ms",
    "step_predicted_ewma_ms",
    "step_measured_ewma_ms",
    "itl_target_ms",
    "num_host_blocks",
    "num_free_host_blocks",
    "host_cache_usage",
    "prefix_cache_host_hit_tokens",
    "num_swap_outs",
    "num_swap_ins",
    "num_swap_failures",
    "prefix_cache_storage_hit_tokens",
    "num_storage_writes",
    "num_storage_fetches",
    "prefix_cache_prefetched_hit_tokens",
    "num_storage_prefetches",
    "encoder_cache_size",
    "encoder_cache_used",
    "encoder_cache_hits",
    "encoder_cache_misses",
    "encoder_cache_evictions",
)


def instance_status(eng: InstanceEngine) -> apb.InstanceStatus:
    st = apb.InstanceStatus(
        instance_id=eng.instance_id,
        role=codec.role_to_proto(eng.role),
        ready=eng.ready,
        draining=eng.draining,
        num_ranks_connected=len(eng.ranks),
        world_size=eng.world_size,
        model=eng.limits.model if eng.limits is not None else "",
        block_size=next((c.block_size for c in eng.ranks.values()), 0),
    )
    snap = eng.snapshot()
    if snap is not None:
        for name in _FROM_SNAPSHOT:
            setattr(st, name, getattr(snap, name))
        st.steps_per_s = eng.steps_per_s()
        st.num_storage_failures = snap.num_storage_write_failures + snap.num_storage_fetch_failures
    return st


class AdminServicer(admin_service_pb2_grpc.AdminServiceServicer):
    """Reads and steers the instances of `registry`; `requests` tells whether the daemon
    drains."""

    def __init__(self, registry: InstanceRegistry, requests: RequestTable) -> None:
        self.registry = registry
        self.requests = requests

    async def GetStatus(
        self, request: apb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> apb.GetStatusResponse:
        engines = self.registry.select(request.instance_id)
        every = self.registry.engines.values()
        # Draining: no new request is admitted anywhere, because the daemon shuts down or
        # because every instance drains (Drain without an instance id, or one by one).
        draining = self.requests.draining or (bool(every) and all(e.draining for e in every))
        out = apb.GetStatusResponse(draining=draining, paused=self.registry.paused)
        for eng in engines:
            st = instance_status(eng)
            out.instances.append(st)
            out.num_waiting += st.num_waiting
            out.num_running += st.num_running
        cluster = self.requests.cluster
        if cluster is not None:
            out.cluster.CopyFrom(cluster.cluster_status())
        return out

    def _each(self, instance_id: str, action: Callable[[InstanceEngine], object]) -> list[str]:
        """Apply `action` to the named instance (all when empty), wake it, return the ids."""
        engines = self.registry.select(instance_id)
        for eng in engines:
            action(eng)
            eng.wake()
        return [e.instance_id for e in engines]

    async def Drain(
        self, request: apb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> apb.DrainResponse:
        return apb.DrainResponse(instance_ids=self._each(request.instance_id, InstanceEngine.drain))

    async def Pause(
        self, request: apb.PauseRequest, context: grpc.aio.ServicerContext
    ) -> apb.PauseResponse:
        ids = self._each(request.instance_id, InstanceEngine.pause)
        if not request.instance_id:
            self.registry.paused = True
        return apb.PauseResponse(instance_ids=ids)

    async def Resume(
        self, request: apb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> apb.ResumeResponse:
        ids = self._each(request.instance_id, InstanceEngine.resume)
        if not request.instance_id:
            self.registry.paused = False
        return apb.ResumeResponse(instance_ids=ids)

    async def ResetPrefixCache(
        self, request: apb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> apb.ResetPrefixCacheResponse:
        ids = self._each(request.instance_id, InstanceEngine.reset_prefix_cache)
        return apb.ResetPrefixCacheResponse(instance_ids=ids)
