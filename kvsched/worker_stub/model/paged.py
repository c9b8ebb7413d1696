"""The `model` executor: the seeded transformer (`transformer.Transformer`) on a paged KV cache
addressed by the daemon's block tables, with its host KV pool, encoder outputs, speculative
verification, storage bytes and prefill -> decode KV export/import.

Paged cache addressing (one K and one V cache per layer, stored flat by slot):

    cache[layer]  [num_blocks * block_size, kv_heads, head_dim]  = [num_blocks, block_size, ...]
    slot(p)       block_ids[p // block_size] * block_size + p % block_size

    a sequence with start=s and n token_ids:   positions [s, s + n) are written this step;
    its attention reads slots of positions [0, s + n) in block-table order, causal within the step.
"""

from __future__ import annotations

import time

import numpy as np

from kvsched.worker_stub.executor import SeqWork, StepResult
from kvsched.worker_stub.model.backend import Array, Backend
from kvsched.worker_stub.model.encoder import EncoderOutputs, placeholder_rows
from kvsched.worker_stub.model.host_pool import HostKvPool
from kvsched.worker_stub.model.transformer import (
    _EMBED_STD,
    AttentionFn,
    ModelConfig,
    Transformer,
    accept_greedy,
)

_CACHE_NOISE_STD = 30.0  # unwritten cache slots hold large noise, never plausible zeros


class PagedModelExecutor:
    """The `model` executor: the transformer on a paged KV cache addressed by block tables."""

    name = "model"

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        backend: Backend | str = "numpy",
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(
                f"num_blocks and block_size must be >= 1 and num_host_blocks >= 0, got "
                f"{num_blocks}, {block_size}, {num_host_blocks}"
            )
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model = Transformer(config, backend)
        self.backend = self.model.backend
        self.k_cache: list[Array] = []
        self.v_cache: list[Array] = []
        self.host = HostKvPool(config, num_host_blocks, block_size)
        self.encoder = EncoderOutputs(config.hidden, config.seed, _EMBED_STD)
        self.reset()

    def reset(self) -> None:
        """Refill the cache with large seeded noise, so reading a slot nobody wrote changes
        tokens instead of quietly reading zeros."""
        c = self.config
        rng = np.random.default_rng([c.seed, 0x4B56])
        shape = (self.num_blocks * self.block_size, c.num_kv_heads, c.head_dim)

        def noise() -> Array:
            return self.backend.asarray(rng.standard_normal(shape) * _CACHE_NOISE_STD)

        self.k_cache = [noise() for _ in range(c.num_layers)]
        self.v_cache = [noise() for _ in range(c.num_layers)]
        self.host.fill_noise()
        self.encoder.clear()

    # ---- the encoder cache (encoder.py) -------------------------------------------------------
    def drop_encoder_items(self, hashes: list[str]) -> None:
        """Tasks.encoder_drops: forget those items' encoder outputs."""
        self.encoder.drop(hashes)

    def clear_encoder(self) -> None:
        """reset_prefix_cache: forget every encoder output."""
        self.encoder.clear()

    # ---- the host tier (host_pool.HostKvPool holds the memory) -------------------------------
    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        """Copy GPU blocks (all layers' K and V) into host blocks."""
        b = self.backend
        src = b.asindex(self._block_slots(gpu_ids))
        rows = [
            b.to_numpy(b.gather(cache[i], src))
            for i in range(self.config.num_layers)
            for cache in (self.k_cache, self.v_cache)
        ]
        self.host.write(host_ids, rows)

    def swap_in(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        """Copy host blocks into GPU blocks."""
        b = self.backend
        dst = b.asindex(self._block_slots(gpu_ids))
        rows = self.host.read(host_ids)
        for i in range(self.config.num_layers):
            b.scatter_(self.k_cache[i], dst, b.asarray(rows[2 * i]))
            b.scatter_(self.v_cache[i], dst, b.asarray(rows[2 * i + 1]))

    def drop_host(self) -> None:
        """The daemon forgot the host tier: refill it with noise, so a swap-in of a block it
        no longer names would change tokens."""
        self.host.fill_noise()

    # ---- the storage tier (worker_stub/storage_kv.py puts and gets the bytes) ----------------
    def storage_read(self, block_ids: list[int]) -> list[bytes]:
        """One blob per block, export_kv's layout: host blocks when this executor has a host
        tier (the daemon then names host block ids), else GPU blocks."""
        if not self.host.num_blocks:
            return [self.export_kv([i]) for i in block_ids]
        dtype = self.config.dtype
        return [
            np.ascontiguousarray(np.stack(self.host.read([i])), dtype).tobytes() for i in block_ids
        ]

    def storage_write(self, gpu_ids: list[int], blobs: list[bytes | None]) -> None:
        """Write one blob of storage_read per GPU block; ValueError (nothing written) when one
        is missing or of the wrong size."""
        c = self.config
        expected = 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim
        expected *= np.dtype(c.dtype).itemsize
        bad = [i for i, blob in enumerate(blobs) if blob is None or len(blob) != expected]
        if bad or len(blobs) != len(gpu_ids):
            raise ValueError(f"{len(bad)} of {len(gpu_ids)} blocks missing or not {expected} bytes")
        for gpu_id, blob in zip(gpu_ids, blobs, strict=True):
            self.import_kv([gpu_id], blob or b"")

    def storage_write_host(self, host_ids: list[int], blobs: list[bytes | None]) -> None:
        """Write one blob of storage_read (a host tier's layout) into each host block (a
        storage -> host prefetch); ValueError (nothing written) when one is missing or of the
        wrong size."""
        c = self.config
        shape = (2 * c.num_layers, self.block_size, c.num_kv_heads, c.head_dim)
        expected = int(np.prod(shape)) * np.dtype(c.dtype).itemsize
        if len(blobs) != len(host_ids) or any(b is None or len(b) != expected for b in blobs):
            raise ValueError(f"{len(host_ids)} blocks: one missing or not {expected} bytes")
        for hid, blob in zip(host_ids, blobs, strict=True):
            rows = np.frombuffer(blob or b"", dtype=c.dtype).reshape(shape)
            self.host.write([hid], list(rows))

    def execute(self, work: list[SeqWork]) -> StepResult:
        """Compute the K/V of every SeqWork's tokens into its blocks, then sample where asked.

        Every SeqWork is validated before the cache is touched; a bad one raises ValueError.
        """
        started = time.perf_counter()
        if not work:
            return StepResult(tokens=[], step_time_s=0.0)
        context_slots = [self._context_slots(w) for w in work]
        bounds = np.cumsum([0] + [len(w.token_ids) for w in work])
        tokens = np.concatenate([np.asarray(w.token_ids, dtype=np.int64) for w in work])
        positions = np.concatenate([np.arange(w.start, w.start + len(w.token_ids)) for w in work])
        attention = self._paged_attention(work, context_slots, bounds)
        spans = [
            (int(bounds[i]), w.start, len(w.token_ids), w.mm_ranges) for i, w in enumerate(work)
        ]
        embeds = placeholder_rows([s for s in spans if s[3]], self.encoder.get)
        hidden = self.model.forward(tokens, positions, attention, embeds)
        sampled = self._sample(work, hidden, bounds)
        return StepResult(tokens=sampled, step_time_s=time.perf_counter() - started)

    def _paged_attention(
        self, work: list[SeqWork], context_slots: list[np.ndarray], bounds: np.ndarray
    ) -> AttentionFn:
        """Per layer: write the step's K/V to their slots, then let each sequence attend over
        the slots of its whole context, gathered in block-table order."""
        b = self.backend
        written = [slots[w.start :] for w, slots in zip(work, context_slots, strict=True)]
        writes = b.asindex(np.concatenate(written))
        reads = [b.asindex(s) for s in context_slots]

        def attention(layer: int, q: Array, k: Array, v: Array) -> Array:
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            b.scatter_(k_cache, writes, k)
            b.scatter_(v_cache, writes, v)
            outs = [
                self.model.attend(
                    q[bounds[i] : bounds[i + 1]],
                    b.gather(k_cache, reads[i]),
                    b.gather(v_cache, reads[i]),
                    w.start,
                )
                for i, w in enumerate(work)
            ]
            return outs[0] if len(outs) == 1 else b.concat(outs, axis=0)

        return attention

    def _sample(self, work: list[SeqWork], hidden: Array, bounds: np.ndarray) -> list[list[int]]:
        """Greedy tokens at the last 1 + num_draft positions of each sampling SeqWork, verified."""
        b = self.backend
        rows = [
            np.arange(bounds[i + 1] - 1 - w.num_draft, bounds[i + 1]) for i, w in enumerate(work)
        ]
        sampling = [i for i, w in enumerate(work) if w.sample]
        if not sampling:
            return [[] for _ in work]
        index = b.asindex(np.concatenate([rows[i] for i in sampling]))
        greedy = b.argmax(self.model.logits(b.gather(hidden, index))).tolist()
        result: list[list[int]] = [[] for _ in work]
        for i in sampling:
            num_draft = work[i].num_draft
            result[i] = accept_greedy(work[i].token_ids, num_draft, greedy[: num_draft + 1])
            greedy = greedy[num_draft + 1 :]
        return result

    def _context_slots(self, w: SeqWork) -> np.ndarray:
        """Slots of positions [0, start + len(token_ids)) through the block table; validates w."""
        end = w.start + len(w.token_ids)
        where = f"handle {w.handle} ({w.req_id})"
        if not w.token_ids or w.start < 0:
            raise ValueError(f"{where}: empty token_ids or negative start {w.start}")
        if end > self.config.max_model_len:
            raise ValueError(f"{where}: position {end - 1} >= {self.config.max_model_len}")
        if end > len(w.block_ids) * self.block_size:
            raise ValueError(f"{where}: {len(w.block_ids)} blocks cannot hold {end} positions")
        if not 0 <= w.num_draft < len(w.token_ids):
            raise ValueError(f"{where}: num_draft {w.num_draft} with {len(w.token_ids)} tokens")
        if min(w.token_ids) < 0 or max(w.token_ids) >= self.config.vocab_size:
            raise ValueError(f"{where}: token id outside [0, {self.config.vocab_size})")
        table = self._table(w.block_ids)
        positions = np.arange(end)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _table(self, block_ids: list[int]) -> np.ndarray:
        table = np.asarray(block_ids, dtype=np.int64)
        if table.size and (table.min() < 0 or table.max() >= self.num_blocks):
            raise ValueError(f"block id outside [0, {self.num_blocks}) in {block_ids}")
        return table

    def _block_slots(self, block_ids: list[int]) -> np.ndarray:
        table = self._table(block_ids)
        return (table[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)

    def export_kv(self, block_ids: list[int]) -> bytes:
        """K and V of these blocks, all layers, as raw `config.dtype` bytes laid out
        [num_layers, 2 (K, V), len(block_ids), block_size, kv_heads, head_dim]."""
        b = self.backend
        index = b.asindex(self._block_slots(block_ids))
        parts = [
            b.to_numpy(b.gather(cache[i], index))
            for i in range(self.config.num_layers)
            for cache in (self.k_cache, self.v_cache)
        ]
        return np.ascontiguousarray(np.stack(parts), dtype=self.config.dtype).tobytes()

    def import_kv(self, block_ids: list[int], data: bytes) -> None:
        """Write bytes from `export_kv` of an executor with the same config and block_size into
        these blocks, in order. Wrong-sized data raises ValueError and writes nothing."""
        c, b = self.config, self.backend
        slots = self._block_slots(block_ids)
        shape = (c.num_layers * 2, len(slots), c.num_kv_heads, c.head_dim)
        expected = int(np.prod(shape)) * np.dtype(c.dtype).itemsize
        if len(data) != expected:
            raise ValueError(f"KV of {len(block_ids)} blocks is {expected} bytes, got {len(data)}")
        arr = np.frombuffer(data, dtype=c.dtype).reshape(shape)
        index = b.asindex(slots)
        for i in range(c.num_layers):
            b.scatter_(self.k_cache[i], index, b.asarray(arr[2 * i]))
            b.scatter_(self.v_cache[i], index, b.asarray(arr[2 * i + 1]))
