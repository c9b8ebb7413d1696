"""The scheduling engine: pure, deterministic, no I/O.

Layers, bottom up:  BlockPool (mechanism) -> KVCacheManager (per-request tables, prefix cache)
-> Scheduler (policy, one per instance) -> Router (picks an instance for a new request).
"""

from kvsched.core.block_pool import BlockPool
from kvsched.core.config import (
    CacheConfig,
    EngineConfig,
    Role,
    SchedulerConfig,
    SpeculativeConfig,
)
from kvsched.core.errors import (
    CapacityExceeded,
    ConfigError,
    InvalidRequest,
    KvschedError,
    ProtocolError,
    RequestNotFound,
    Unavailable,
)
from kvsched.core.kv_cache_manager import KVCacheManager
from kvsched.core.protocol import (
    Chunk,
    Extension,
    FinishReason,
    KvSend,
    MultimodalRange,
    Placement,
    SamplingParams,
    StepReport,
    Tasks,
)
from kvsched.core.request import Request, RequestStatus
from kvsched.core.router import Router
from kvsched.core.scheduler import (
    DecodeColumn,
    Events,
    RowTokens,
    Scheduler,
    SchedulerSnapshot,
    TokenDelta,
)
from kvsched.core.storage import StorageIndex

__all__ = [
    "BlockPool",
    "CacheConfig",
    "CapacityExceeded",
    "Chunk",
    "ConfigError",
    "DecodeColumn",
    "EngineConfig",
    "Events",
    "Extension",
    "FinishReason",
    "InvalidRequest",
    "KVCacheManager",
    "KvSend",
    "KvschedError",
    "MultimodalRange",
    "Placement",
    "ProtocolError",
    "Request",
    "RequestNotFound",
    "RequestStatus",
    "Role",
    "Router",
    "RowTokens",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerSnapshot",
    "SpeculativeConfig",
    "StepReport",
    "StorageIndex",
    "Tasks",
    "TokenDelta",
    "Unavailable",
]
