"""The cluster index's inverted half: per medium, block hash -> the instances holding it, and
the longest cached run of a prompt on every instance at once (pure, no I/O).

Routing over a thousand peer instances cannot ask each one in turn (a Python loop of ~1 us
per instance is a millisecond). Instances get a small integer slot; `runs` walks the prompt's
chained hashes once, intersecting the sets of slots that still continue their run (C-level
set operations), so its cost follows the prompt's shared prefix, not the number of instances.
A run is the GPU prefix first, then its continuation in host memory (the rule of one
instance's `Scheduler.prefix_hit_tokens`); the storage medium is reserved (`kv_events.MEDIA`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvsched.core.kv_events import CPU, GPU

_EMPTY: frozenset[int] = frozenset()
_FEW = 8  # continuing slots at or below which each run is finished alone
IntArray = npt.NDArray[np.int32]


class HitIndex:
    """Owns, per indexed medium, hash -> set of instance slots."""

    MEDIA = (GPU, CPU)

    def __init__(self) -> None:
        self.holders: dict[str, dict[bytes, set[int]]] = {m: {} for m in self.MEDIA}
        # Per slot, its own (GPU, host) hash sets (the ClusterIndex's views keep them): once
        # few instances still continue a run, each is finished alone against its own sets.
        self.own: dict[int, tuple[set[bytes], set[bytes]]] = {}

    def bind(self, slot: int, gpu: set[bytes], host: set[bytes]) -> None:
        """The sets holding `slot`'s hashes (kept equal to what add/remove were told)."""
        self.own[slot] = (gpu, host)

    def add(self, medium: str, slot: int, hashes: Iterable[bytes]) -> None:
        d = self.holders.get(medium)
        if d is None:
            return
        for h in hashes:
            s = d.get(h)
            if s is None:
                d[h] = {slot}
            else:
                s.add(slot)

    def remove(self, medium: str, slot: int, hashes: Iterable[bytes]) -> None:
        d = self.holders.get(medium)
        if d is None:
            return
        for h in hashes:
            s = d.get(h)
            if s is not None:
                s.discard(slot)
                if not s:
                    del d[h]

    def runs(self, hashes: list[bytes], size: int) -> tuple[IntArray, IntArray]:
        """(GPU blocks, GPU + host blocks) of the longest cached run of `hashes` from its start,
        per slot (arrays of `size`; 0 where nothing hits)."""
        gpu_len = np.zeros(size, np.int32)
        all_len = np.zeros(size, np.int32)
        if not hashes:
            return gpu_len, all_len
        gpu, cpu = self.holders[GPU], self.holders[CPU]
        alive: set[int] | frozenset[int] = gpu.get(hashes[0], _EMPTY)
        on_host: set[int] | frozenset[int] = cpu.get(hashes[0], _EMPTY) - alive
        j, nb = 1, len(hashes)
        while (alive or on_host) and j < nb:
            if len(alive) + len(on_host) <= _FEW:
                self._finish(hashes, j, alive, on_host, gpu_len, all_len)
                return gpu_len, all_len
            h = hashes[j]
            nxt = alive & gpu.get(h, _EMPTY)
            cs = cpu.get(h, _EMPTY)
            host_next = on_host & cs if on_host else on_host
            if len(on_host) != len(host_next):
                all_len[list(on_host - host_next)] = j
            if len(nxt) != len(alive):
                dropped = alive - nxt
                gpu_len[list(dropped)] = j
                cont = dropped & cs
                if len(cont) != len(dropped):
                    all_len[list(dropped - cont)] = j
                host_next = host_next | cont
            alive, on_host = nxt, host_next
            j += 1
        if alive:
            ix = list(alive)
            gpu_len[ix] = j
            all_len[ix] = j
        if on_host:
            all_len[list(on_host)] = j
        return gpu_len, all_len

    def _finish(
        self,
        hashes: list[bytes],
        j: int,
        alive: Iterable[int],
        on_host: Iterable[int],
        gpu_len: IntArray,
        all_len: IntArray,
    ) -> None:
        """The runs of the few slots still continuing at block j, each walked in its own
        sets (C-level `takewhile` over the prompt: no set operations per block)."""
        own = self.own
        for s in alive:
            gpu, host = own[s]
            g = j + _run(gpu, hashes, j)
            gpu_len[s] = g
            all_len[s] = g + _run(host, hashes, g)
        for s in on_host:
            all_len[s] = j + _run(own[s][1], hashes, j)


def _run(held: set[bytes], hashes: list[bytes], start: int) -> int:
    """How many of hashes[start:] in a row `held` contains."""
    return len(list(itertools.takewhile(held.__contains__, itertools.islice(hashes, start, None))))
