"""The host-memory KV tier of the vllm executor: functions that run inside vLLM's worker process
(through the executor's `collective_rpc`), where its KV cache tensors live. Each copies whole
blocks of every layer's cache between that cache and a dict of host tensors kept in the same
process. Block ids are vLLM's (kvsched's + 1).
"""

from __future__ import annotations

from typing import Any

# host block id -> one tensor per layer (the block's slice of that layer's cache)
_HOST: dict[int, list[Any]] = {}


def _caches(worker: Any) -> tuple[list[Any], int]:
    """The per-layer KV cache tensors and the number of blocks they hold."""
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    caches = [t for t in runner.kv_caches if t is not None]
    if not caches:
        raise RuntimeError("the vLLM worker has no KV cache tensors")
    return caches, int(runner.kv_cache_config.num_blocks)


def _block_dim(t: Any, num_blocks: int) -> int:
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise RuntimeError(f"no dimension of {num_blocks} blocks in a KV cache of shape {t.shape}")


def swap_out(worker: Any, gpu_ids: list[int], host_ids: list[int]) -> int:
    """Copy cache blocks gpu_ids[i] into host block host_ids[i]; returns the host pool's size."""
    caches, n = _caches(worker)
    for g, h in zip(gpu_ids, host_ids, strict=True):
        _HOST[h] = [t.select(_block_dim(t, n), g).clone() for t in caches]
    return len(_HOST)


def swap_in(worker: Any, host_ids: list[int], gpu_ids: list[int]) -> None:
    """Copy host block host_ids[i] into cache block gpu_ids[i]; KeyError for a host block
    never written (or dropped)."""
    caches, n = _caches(worker)
    missing = [h for h in host_ids if h not in _HOST]
    if missing:
        raise KeyError(f"host blocks {missing} hold nothing")
    for h, g in zip(host_ids, gpu_ids, strict=True):
        for t, data in zip(caches, _HOST[h], strict=True):
            t.select(_block_dim(t, n), g).copy_(data)


def drop(worker: Any) -> None:
    """Forget every host block."""
    _HOST.clear()
