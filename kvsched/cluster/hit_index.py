"""The cluster index's inverted half: per medium, block hash -> the instances holding it, and
the longest cached run of a prompt on every instance at once (pure, no I/O).

Routing over a thousand peer instances cannot ask each one in turn (a Python loop of ~1 us
per instance is a millisecond). Instances get a small integer slot, and the instances holding
a hash are a bitmask of slots (a Python int: AND/OR over 1,000 slots are a few dozen machine
words, ~0.1 us). `runs` walks the prompt's chained hashes once, ANDing the masks of the slots
that still continue their run; once only a few continue, each is finished alone against its
own hash sets (C-level `takewhile`). Its cost follows the prompt's shared prefix, not the
number of instances. A run is the GPU prefix first, then its continuation in host memory (the
rule of one instance's `Scheduler.prefix_hit_tokens`); storage is reserved (`kv_events.MEDIA`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from kvsched.core.kv_events import CPU, GPU

_FEW = 1  # continuing slots at or below which each run is finished alone (one walk of its
# own sets, C-level; with more, the masks need fewer lookups than one walk per slot)
IntArray = npt.NDArray[np.int32]


def slots_of(mask: int) -> list[int]:
    """The slots set in a bitmask, ascending."""
    out: list[int] = []
    if mask.bit_count() <= 16:
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    out.extend(np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist())
    return out


def _set(arr: IntArray, mask: int, value: int) -> None:
    """arr[slot] = value for every slot set in mask (few: one by one; many: a boolean mask)."""
    if mask.bit_count() <= 16:
        while mask:
            low = mask & -mask
            arr[low.bit_length() - 1] = value
            mask ^= low
        return
    raw = np.frombuffer(mask.to_bytes((arr.size + 7) // 8, "little"), np.uint8)
    arr[np.unpackbits(raw, bitorder="little", count=arr.size).view(bool)] = value


class HitIndex:
    """Owns, per indexed medium, hash -> bitmask of the instance slots holding it."""

    MEDIA = (GPU, CPU)

    def __init__(self) -> None:
        self.holders: dict[str, dict[bytes, int]] = {m: {} for m in self.MEDIA}
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
        bit, get = 1 << slot, d.get
        for h in hashes:
            d[h] = get(h, 0) | bit

    def remove(self, medium: str, slot: int, hashes: Iterable[bytes]) -> None:
        d = self.holders.get(medium)
        if d is None:
            return
        keep, get = ~(1 << slot), d.get
        for h in hashes:
            m = get(h)
            if m is not None:
                m &= keep
                if m:
                    d[h] = m
                else:
                    del d[h]

    def runs(self, hashes: list[bytes], size: int) -> tuple[IntArray, IntArray]:
        """(GPU blocks, GPU + host blocks) of the longest cached run of `hashes` from its start,
        per slot (arrays of `size`; 0 where nothing hits)."""
        gpu_len = np.zeros(size, np.int32)
        all_len = np.zeros(size, np.int32)
        if not hashes:
            return gpu_len, all_len
        gpu, cpu = self.holders[GPU].get, self.holders[CPU].get
        alive = gpu(hashes[0], 0)  # slots whose GPU run continues
        on_host = cpu(hashes[0], 0) & ~alive  # slots whose run continues in host memory
        j, nb = 1, len(hashes)
        if (alive | on_host).bit_count() <= _FEW:
            self._finish(hashes, j, slots_of(alive), slots_of(on_host), gpu_len, all_len)
            return gpu_len, all_len
        while j < nb and (alive or on_host):
            h = hashes[j]
            nxt = alive & gpu(h, 0)
            cs = -1  # the host holders of h, looked up only when needed
            if on_host:
                cs = cpu(h, 0)
                host_next = on_host & cs
                if host_next != on_host:
                    _set(all_len, on_host ^ host_next, j)
                    on_host = host_next
            if nxt != alive:
                dropped = alive ^ nxt
                _set(gpu_len, dropped, j)
                if cs < 0:
                    cs = cpu(h, 0)
                cont = dropped & cs
                if cont != dropped:
                    _set(all_len, dropped ^ cont, j)
                alive, on_host = nxt, on_host | cont
                if (alive | on_host).bit_count() <= _FEW:
                    j += 1
                    self._finish(hashes, j, slots_of(alive), slots_of(on_host), gpu_len, all_len)
                    return gpu_len, all_len
            j += 1
        _set(gpu_len, alive, j)
        _set(all_len, alive | on_host, j)
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
        sets (C-level `takewhile` over the prompt: no mask operations per block)."""
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
