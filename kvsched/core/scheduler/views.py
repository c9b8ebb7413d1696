"""The snapshot's cache-tier fields (`Scheduler.snapshot`): the host tier's, the storage
tier's and the encoder cache's numbers, read off their owners (each absent when off).

Reads only; imported by the scheduler facade.
"""

from __future__ import annotations

from typing import Any

from kvsched.core.encoder_cache import EncoderCache
from kvsched.core.kv_cache_manager import KVCacheManager


def cache_views(kv: KVCacheManager, enc: EncoderCache | None) -> dict[str, Any]:
    """SchedulerSnapshot fields of the host tier, the storage tier and the encoder cache."""
    out: dict[str, Any] = {}
    host = kv.host
    if host is not None:
        hs = host.stats
        out |= {
            "num_host_blocks": host.num_blocks,
            "num_free_host_blocks": host.num_free,
            "host_cache_usage": host.pool.usage,
            "prefix_cache_host_hit_tokens": kv.num_host_hits,
            "num_swap_outs": hs.swap_outs,
            "num_swap_ins": hs.swap_ins,
            "num_swap_failures": hs.swap_out_failures + hs.swap_in_failures,
            "num_swap_ins_declined": hs.swap_ins_declined,
        }
    st = kv.storage
    if st is not None:
        ss = st.stats
        out |= {
            "storage_enabled": True,
            "prefix_cache_storage_hit_tokens": kv.num_storage_hits,
            "num_storage_writes": ss.writes,
            "num_storage_fetches": ss.fetches,
            "num_storage_write_failures": ss.write_failures,
            "num_storage_fetch_failures": ss.fetch_failures,
            "num_storage_fetches_declined": ss.fetches_declined,
        }
    if kv.prefetch is not None:
        ps = kv.prefetch.stats
        out |= {
            "num_storage_prefetches": ps.prefetches,
            "num_storage_prefetch_failures": ps.failures,
            "prefix_cache_prefetched_hit_tokens": kv.num_prefetched_hits,
        }
    if enc is not None:
        es = enc.stats
        out |= {
            "encoder_cache_size": enc.capacity,
            "encoder_cache_used": enc.used,
            "encoder_cache_hits": es.hits,
            "encoder_cache_misses": es.misses,
            "encoder_cache_evictions": es.evictions,
        }
    return out
