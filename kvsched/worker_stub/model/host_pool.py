"""The `model` executor's host-memory KV pool: numpy arrays in host memory, whatever the GPU
backend (numpy or Paddle), addressed only by the host block ids the daemon's copies name.

Layout per layer and K/V: [num_host_blocks * block_size, kv_heads, head_dim]. Unwritten rows
hold large seeded noise (as the GPU cache does), and so does every row after `fill_noise`
(reset, reset_prefix_cache): a swap-in of a host block nobody wrote changes tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_NOISE_STD = 30.0


class HostKvPool:
    def __init__(self, config: Any, num_blocks: int, block_size: int) -> None:
        """config: the model's ModelConfig (num_layers, num_kv_heads, head_dim, dtype, seed)."""
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self._fills = 0

    def fill_noise(self) -> None:
        c = self.config
        self._fills += 1
        rng = np.random.default_rng([c.seed, 0x4B57, self._fills])
        shape = (self.num_blocks * self.block_size, c.num_kv_heads, c.head_dim)
        self.k = [
            (rng.standard_normal(shape) * _NOISE_STD).astype(c.dtype) for _ in range(c.num_layers)
        ]
        self.v = [
            (rng.standard_normal(shape) * _NOISE_STD).astype(c.dtype) for _ in range(c.num_layers)
        ]

    def _slots(self, host_ids: list[int]) -> np.ndarray:
        ids = np.asarray(host_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"host block id outside [0, {self.num_blocks}) in {host_ids}")
        return (ids[:, None] * self.block_size + np.arange(self.block_size)).reshape(-1)

    def write(self, host_ids: list[int], rows: list[np.ndarray]) -> None:
        """rows: per layer K then V ([2 * num_layers] arrays of the blocks' rows, in order)."""
        slots = self._slots(host_ids)
        for i in range(self.config.num_layers):
            self.k[i][slots] = rows[2 * i]
            self.v[i][slots] = rows[2 * i + 1]

    def read(self, host_ids: list[int]) -> list[np.ndarray]:
        slots = self._slots(host_ids)
        out: list[np.ndarray] = []
        for i in range(self.config.num_layers):
            out.extend((self.k[i][slots], self.v[i][slots]))
        return out
