"""KV blocks of the vllm executor as bytes: the prefill/decode hand-off (`export_kv` /
`import_kv`, worker_stub/kv_push.py moves them between workers) and the storage tier
(`storage_read` / `storage_write`, worker_stub/storage_kv.py puts and gets them).

The functions below run inside vLLM's worker process (through the executor's
`collective_rpc`), where its KV cache tensors live, as the host tier's copies do (host.py).
Block ids are vLLM's (kvsched's + 1). One block's bytes are its slice of every layer's cache
tensor, layer after layer, each slice's raw bytes in the cache's own dtype and layout; several
blocks are their bytes one after the other. Only a worker of the same model, dtype, block size
and attention backend can read them: a size that does not match raises ValueError before
anything is written.
"""

from __future__ import annotations

from typing import Any

from kvsched.worker_vllm import host


def _slices(worker: Any, block: int) -> list[Any]:
    caches, n = host._caches(worker)
    return [t.select(host._block_dim(t, n), block) for t in caches]


def _to_bytes(tensors: list[Any]) -> bytes:
    return b"".join(t.contiguous().view(-1).view(_u8()).numpy().tobytes() for t in tensors)


def _u8() -> Any:
    import torch

    return torch.uint8


def block_nbytes(worker: Any) -> int:
    """Bytes of one block (all layers)."""
    return sum(s.numel() * s.element_size() for s in _slices(worker, 0))


def export_blocks(worker: Any, gpu_ids: list[int]) -> bytes:
    """The bytes of cache blocks gpu_ids, in order."""
    return b"".join(_to_bytes(_slices(worker, g)) for g in gpu_ids)


def import_blocks(worker: Any, gpu_ids: list[int], data: bytes | list[bytes]) -> None:
    """Write bytes of `export_blocks` (as many blocks; or one blob per block) into cache
    blocks gpu_ids; ValueError (nothing written) when a size does not match."""
    import torch

    size = block_nbytes(worker)
    blobs = data if isinstance(data, list) else [data]
    want = [size] * len(gpu_ids) if isinstance(data, list) else [size * len(gpu_ids)]
    if len(blobs) != len(want) or any(len(b) != w for b, w in zip(blobs, want, strict=True)):
        got = [len(b) for b in blobs]
        raise ValueError(
            f"KV of {len(gpu_ids)} blocks is {want} bytes here, got {got} "
            "(another model, dtype, block size or attention backend?)"
        )
    if not gpu_ids:
        return
    raw = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    offset = 0
    for g in gpu_ids:
        for s in _slices(worker, g):
            n = s.numel() * s.element_size()
            s.copy_(raw[offset : offset + n].view(s.dtype).view(s.shape))
            offset += n


def export_host(worker: Any, host_ids: list[int]) -> list[bytes]:
    """One blob per host-tier block (host.py's copies), laid out as `export_blocks`'s; KeyError
    for a host block that holds nothing."""
    missing = [h for h in host_ids if h not in host._HOST]
    if missing:
        raise KeyError(f"host blocks {missing} hold nothing")
    return [_to_bytes(host._HOST[h]) for h in host_ids]


def import_host(worker: Any, host_ids: list[int], blobs: list[bytes]) -> None:
    """Put blobs of `export_host`'s layout into host-tier blocks (a storage -> host
    prefetch); ValueError (nothing written) when a size does not match."""
    import torch

    size = block_nbytes(worker)
    if len(blobs) != len(host_ids) or any(len(b) != size for b in blobs):
        raise ValueError(f"KV of {len(host_ids)} host blocks is {size} bytes each here")
    like = _slices(worker, 0)
    for h, blob in zip(host_ids, blobs, strict=True):
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        out, offset = [], 0
        for s in like:
            n = s.numel() * s.element_size()
            out.append(raw[offset : offset + n].view(s.dtype).view(s.shape).clone().to(s.device))
            offset += n
        host._HOST[h] = out


class KvTransfer:
    """The vllm executor's block bytes, through its collective RPC (world size 1: the one
    worker's answer). Block ids are kvsched's."""

    def __init__(self, executor: Any, has_host_tier: bool) -> None:
        self._executor = executor
        self._has_host_tier = has_host_tier

    def _rpc(self, fn: Any, *args: Any) -> Any:
        return self._executor.collective_rpc(fn, args=args)[0]

    def export_kv(self, block_ids: list[int]) -> bytes:
        return bytes(self._rpc(export_blocks, [b + 1 for b in block_ids]))

    def import_kv(self, block_ids: list[int], data: bytes) -> None:
        self._rpc(import_blocks, [b + 1 for b in block_ids], data)

    def storage_read(self, block_ids: list[int]) -> list[bytes]:
        """One blob per block: host blocks when the executor has a host tier (the daemon then
        names host block ids, as for every executor), else cache blocks."""
        if self._has_host_tier:
            return list(self._rpc(export_host, block_ids))
        return [self.export_kv([b]) for b in block_ids]

    def storage_write(self, gpu_ids: list[int], blobs: list[bytes | None]) -> None:
        """One blob of storage_read per cache block; ValueError (nothing written) when one is
        missing or of the wrong size."""
        if len(blobs) != len(gpu_ids) or any(b is None for b in blobs):
            raise ValueError(f"{sum(b is None for b in blobs)} of {len(gpu_ids)} blocks missing")
        if gpu_ids:
            self._rpc(import_blocks, [g + 1 for g in gpu_ids], [b or b"" for b in blobs])

    def storage_write_host(self, host_ids: list[int], blobs: list[bytes | None]) -> None:
        """One blob of storage_read per host-tier block (a storage -> host prefetch)."""
        if len(blobs) != len(host_ids) or any(b is None for b in blobs):
            raise ValueError(f"{sum(b is None for b in blobs)} of {len(host_ids)} blocks missing")
        if host_ids:
            self._rpc(import_host, host_ids, [b or b"" for b in blobs])
