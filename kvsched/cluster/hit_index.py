"""The cluster index's inverted half: block hash -> the instances holding it (per private tier)
and the hashes the shared storage tier holds, and the longest cached run of a prompt on every
instance at once (pure, no I/O).

Routing over a thousand peer instances cannot ask each one in turn (a Python loop of ~1 us per
instance is a millisecond). Instances get a small integer slot; a hash's holders are ONE Python
int, bit 2s for slot s's GPU pool and bit 2s + 1 for its host memory (AND/OR over 1,000 slots
are a few dozen machine words). Hashes are keyed by their first 8 bytes as an int (`key64`; 2^-64
per pair of a false hit, a routing hint's risk only). A decision is one dict lookup per prompt
block, AND-ed with the bits the runs still need and compared, all at C level (`map`,
`compress`): the interpreter runs once per block where some run ends (a handful per prompt),
not once per block, and independent lookups' cache misses overlap. Updates are C-level too
(`dict.update` over `map`).

A run is the GPU prefix first, then its continuation in host memory (the rule of one instance's
`Scheduler.prefix_hit_tokens`), then in the storage tier. The storage tier is shared by every
instance, so it is one set of keys per model (a namespace: `kvsched.core.storage`'s keys hold the
model and the block size; this index is per block size already through the caller), not a bit per
slot: its continuation from a position is the same for every instance that has a storage tier.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterable, KeysView, Sequence

import numpy as np
import numpy.typing as npt

from kvsched.core.kv_events import CPU, GPU, STORAGE

IntArray = npt.NDArray[np.int32]
# A set of hash keys kept as a dict's keys (values None). A dict holding only ints is not
# tracked by the garbage collector, a set always is: with a 1,000-instance index (2.6 million
# keys in 2,000 per-instance sets) every full collection traversed them all, 128-158 ms
# (measured); as dicts, < 1 ms (`bench.router_scale`, column "full gc ms").
KeySet = dict[int, None]
FloatArray = npt.NDArray[np.float64]
_EVEN = int("55" * 128, 16)  # GPU bits of the first 512 slots (widened on demand: `_even`)
_BULK_MIN = 4096  # keys from which `HitIndex.add_many` groups them by key first
_BULK_SHIFT = 16  # 2**16 distinct keys per matrix of holder bytes (x 250 B at 1,000 slots)


def key64(h: bytes) -> int:
    """A block hash's index key: its first 8 bytes as an unsigned int in the machine's byte
    order (keys never leave the process)."""
    return int.from_bytes(h[:8], sys.byteorder)


def keys_of(hashes: Sequence[bytes]) -> list[int]:
    """`key64` of each hash (one C-level unpack when all are kvsched's 16-byte hashes)."""
    raw = b"".join(hashes)
    if len(raw) == 16 * len(hashes):  # kvsched's blake2b-128 hashes: a view, no Python loop
        keys: list[int] = memoryview(raw).cast("Q")[::2].tolist()
        return keys
    return [key64(h) for h in hashes]


def keys_of_hex(hexes: Sequence[str]) -> list[int]:
    """`key64` of each hash given in hex (the wire's form; one C-level decode when all are
    16-byte hashes)."""
    raw = bytes.fromhex("".join(hexes))
    if len(raw) == 16 * len(hexes):
        keys: list[int] = memoryview(raw).cast("Q")[::2].tolist()
        return keys
    return [key64(bytes.fromhex(h)) for h in hexes]


def keys_of_packed(packed: str) -> list[int]:
    """`key64` of each 16-byte hash of a packed hex string (a snapshot's form)."""
    keys: list[int] = memoryview(bytes.fromhex(packed)).cast("Q")[::2].tolist()
    return keys


def slots_of(mask: int) -> list[int]:
    """The slots set in a bitmask of slots (bit s for slot s), ascending."""
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
    """arr[s] = value for every slot s whose GPU bit (2s) is set in mask."""
    if mask.bit_count() <= 16:
        while mask:
            low = mask & -mask
            arr[(low.bit_length() - 1) >> 1] = value
            mask ^= low
        return
    size = arr.size
    raw = np.frombuffer(mask.to_bytes((2 * size + 7) // 8, "little"), np.uint8)
    np.putmask(arr, np.unpackbits(raw, bitorder="little", count=2 * size)[::2].view(bool), value)


class HitIndex:
    """Owns hash key -> holder bits (GPU and host memory, per slot) and the storage tier's keys
    per model namespace."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.storage: dict[str, KeySet] = {}  # namespace (model) -> keys the store holds
        self._even = _EVEN
        self._gpu_size, self._gpu_mask = 0, 0

    def _bit(self, medium: str, slot: int) -> int:
        return 1 << (2 * slot + (medium == CPU))

    def add(self, medium: str, slot: int, keys: Sequence[int], namespace: str = "") -> None:
        """`slot` holds the blocks of these keys (`key64`) in `medium` (storage: the shared
        store of `namespace` holds them)."""
        if medium == STORAGE:
            self.storage.setdefault(namespace, {}).update(dict.fromkeys(keys))
            return
        if medium not in (GPU, CPU):
            return
        d = self.holders
        bit = self._bit(medium, slot)
        d.update(zip(keys, map(bit.__or__, map(d.get, keys, _zeros(keys))), strict=True))

    def add_many(self, parts: Sequence[tuple[str, int, Sequence[int]]]) -> None:
        """`add` of every (medium, slot, keys) of `parts` (private tiers; the same holders as
        adding them one by one, e.g. many snapshots at once). Many keys are grouped by key
        first (a numpy sort) so that each key's holder int is built once and stored once:
        one dict update per distinct key instead of one per (slot, key)."""
        parts = [p for p in parts if p[0] in (GPU, CPU) and len(p[2])]
        n = sum(len(p[2]) for p in parts)
        if n < _BULK_MIN or len({p[1] for p in parts}) < 2:  # one slot: nothing to group
            for medium, slot, part in parts:
                self.add(medium, slot, part)
            return
        keys = np.fromiter(itertools.chain.from_iterable(p[2] for p in parts), np.uint64, n)
        pos = np.repeat(
            np.array([2 * slot + (medium == CPU) for medium, slot, _ in parts], np.int64),
            [len(k) for _, _, k in parts],
        )
        order = np.argsort(keys)
        keys = keys[order]
        first = np.empty(keys.size, bool)
        first[0] = True
        np.not_equal(keys[1:], keys[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        # Holders are built (allocated) and stored in the order the keys first appear (a
        # snapshot's blocks, chain by chain), not in key order: a prompt's walk then finds
        # its blocks' entries and ints near each other in memory (key order scatters them:
        # measured, the walk's p99 1.3x slower).
        by_first = np.argsort(np.minimum.reduceat(order, starts))
        row = np.empty(starts.size, np.int64)
        row[by_first] = np.arange(starts.size)
        row = row[np.cumsum(first) - 1]  # each (slot, key)'s row: its key's rank
        chunked = np.argsort((row >> _BULK_SHIFT).astype(np.uint16), kind="stable")  # radix
        row, pos = row[chunked], pos[order][chunked]
        bounds = np.searchsorted(
            row >> _BULK_SHIFT, np.arange((starts.size >> _BULK_SHIFT) + 2)
        ).tolist()
        width = int(pos.max()) // 8 + 1  # bytes of the widest holder int
        unpack = int.from_bytes
        held: list[int] = []
        for c, (lo, hi) in enumerate(itertools.pairwise(bounds)):  # 64 Ki rows at a time
            a = c << _BULK_SHIFT
            rows = np.zeros((min(starts.size - a, 1 << _BULK_SHIFT), width), np.uint8)
            at = pos[lo:hi]
            np.bitwise_or.at(
                rows, (row[lo:hi] - a, at >> 3), np.left_shift(1, at & 7).astype(np.uint8)
            )
            raw = rows.tobytes()
            held.extend([unpack(raw[i : i + width], "little") for i in range(0, len(raw), width)])
        d = self.holders
        distinct: list[int] = keys[starts][by_first].tolist()
        d.update(
            zip(
                distinct, map(int.__or__, held, map(d.get, distinct, _zeros(distinct))), strict=True
            )
        )

    def remove(self, medium: str, slot: int, keys: Sequence[int], namespace: str = "") -> None:
        if medium == STORAGE:
            discard_keys(self.storage.get(namespace, {}), keys)
            return
        if medium not in (GPU, CPU):
            return
        d = self.holders
        bit = self._bit(medium, slot)  # cleared as (m | bit) ^ bit: no negative ints
        new = list(map(bit.__xor__, map(bit.__or__, map(d.get, keys, _zeros(keys)))))
        d.update(zip(keys, new, strict=True))
        if not all(new):
            for k in itertools.compress(keys, [not m for m in new]):
                if not d.get(k, 1):
                    del d[k]

    def stored(self, namespace: str = "") -> KeysView[int]:
        """The keys the shared store of `namespace` holds (a set-like view)."""
        return self.storage.get(namespace, {}).keys()

    def _gpu_bits(self, size: int) -> int:
        """The GPU bits of slots 0..size-1."""
        if size != self._gpu_size:
            while self._even.bit_length() < 2 * size:
                self._even |= self._even << self._even.bit_length() + 1
            self._gpu_size, self._gpu_mask = size, self._even & ((1 << 2 * size) - 1)
        return self._gpu_mask

    def runs(
        self, hashes: Sequence[bytes], size: int, namespace: str | None = None
    ) -> tuple[IntArray, IntArray, npt.NDArray[np.int64] | None]:
        """Per slot (arrays of `size`; 0 where nothing hits), the longest cached run of
        `hashes` from its start: (GPU blocks, GPU + host blocks) and, per position p, how far
        the storage tier of `namespace` continues a run that reached p (`ends[p]` >= p; an
        array of len(hashes) + 1: ends[p] == p when it holds nothing there); None when
        namespace is None or the store holds none of the prompt."""
        gpu_len = np.zeros(size, np.int32)
        all_len = np.zeros(size, np.int32)
        nb = len(hashes)
        keys = keys_of(hashes)
        ends = None
        store = self.storage.get(namespace) if namespace is not None else None
        if store:
            held = np.fromiter(map(store.__contains__, keys), bool, nb)
            if held.any():
                stop = np.where(held, nb, np.arange(nb))  # the first miss at or after p
                ends = np.arange(nb + 1, dtype=np.int64)
                ends[:nb] = np.minimum.accumulate(stop[::-1])[::-1]
        if not nb:
            return gpu_len, all_len, ends
        get = self.holders.get
        m = get(keys[0], 0)
        bits = self._gpu_bits(size)
        alive = m & bits  # GPU bits of the slots whose GPU run continues
        on_host = (m >> 1) & ~alive & bits  # ... whose run goes on in host memory
        j = 1
        while j < nb and (alive or on_host):
            # The bits the runs need: alive slots' GPU bits, on-host slots' host bits. The
            # next block missing one of them is found at C level (lookups, AND, compare); the
            # interpreter runs once per change of the runs, not once per block.
            need = alive | (on_host << 1)
            rest = map(need.__ne__, map(need.__and__, map(get, keys[j:], _zeros(keys, nb - j))))
            at = next(itertools.compress(itertools.count(j), rest), None)
            if at is None:
                j = nb
                break
            j = at
            m = get(keys[j], 0)
            hm = m >> 1  # the host holders, on the GPU bits
            if on_host:
                host_next = on_host & hm
                if host_next != on_host:
                    _set(all_len, on_host ^ host_next, j)
                    on_host = host_next
            nxt = alive & m
            if nxt != alive:
                dropped = alive ^ nxt
                _set(gpu_len, dropped, j)
                cont = dropped & hm
                if cont != dropped:
                    _set(all_len, dropped ^ cont, j)
                alive, on_host = nxt, on_host | cont
            j += 1
        _set(gpu_len, alive, j)
        _set(all_len, alive | on_host, j)
        return gpu_len, all_len, ends

    def tier_tokens(
        self,
        hashes_for: Callable[[int], Sequence[bytes]],
        sizes: Sequence[int],
        block_size: npt.NDArray[np.float64],
        fetch_block_ms: npt.NDArray[np.float64],
        namespace: str,
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Per slot (block_size's length), tokens of a prompt's longest cached run: (on its GPU,
        in all its tiers, of which in storage). hashes_for(b): the prompt's chained hashes for
        block size b, one of `sizes` (the slots' block sizes); a slot whose fetch_block_ms < 0
        has no storage tier (its run stops after host memory)."""
        size = block_size.size
        if len(sizes) == 1:  # the usual fleet: one block size, no masking
            b = float(sizes[0])
            gpu, total, ends = self.runs(hashes_for(sizes[0]), size, namespace)
            st_tok = np.zeros(size)
            if ends is not None:
                st_tok = np.where(fetch_block_ms >= 0, ends[total] - total, 0) * b
            return (
                np.asarray(gpu * b, np.float64),
                np.asarray(total * b + st_tok, np.float64),
                st_tok,
            )
        gpu_tok, all_tok, st_tok = np.zeros(size), np.zeros(size), np.zeros(size)
        can_fetch = fetch_block_ms >= 0
        for bs in sizes:
            gpu, total, ends = self.runs(hashes_for(bs), size, namespace)
            sel = block_size == bs
            gpu_tok[sel] = gpu[sel] * float(bs)
            if ends is not None:
                more = np.where(can_fetch & sel, ends[total] - total, 0)
                st_tok[sel] = (more * float(bs))[sel]
            all_tok[sel] = total[sel] * float(bs) + st_tok[sel]
        return gpu_tok, all_tok, st_tok


def price_runs(
    gpu: FloatArray,
    host: FloatArray,
    stored: FloatArray,
    swap_ms_per_token: FloatArray,
    fetch_ms_per_token: FloatArray,
    prefill_token_ms: FloatArray,
    attention_ms: FloatArray,
) -> FloatArray:
    """Per slot, the prompt tokens its hit is worth: `core.step_cost.priced_hit_tokens` over
    whole columns (GPU tokens whole; the host run, then the storage run, each by the share of
    its recompute time that swapping it in or fetching it saves; none where moving costs more
    than recomputing)."""
    worth = gpu.astype(np.float64, copy=True)
    start = worth.copy()
    for tokens, per_token in ((host, swap_ms_per_token), (stored, fetch_ms_per_token)):
        if not tokens.any():
            continue
        end = start + tokens
        recompute = prefill_token_ms * tokens + attention_ms * (end * end - start * start) / 2
        pos = recompute > 0
        share = np.zeros_like(recompute)  # transfer time over recompute time
        np.divide(per_token * tokens, recompute, out=share, where=pos)
        worth += np.where(pos, tokens * np.maximum(0.0, 1.0 - share), 0.0)
        start = end
    return worth


def discard_keys(held: KeySet, keys: Iterable[int]) -> None:
    """Remove these keys from a KeySet (those it lacks are ignored)."""
    pop = held.pop
    for k in keys:
        pop(k, None)


def _zeros(keys: Sequence[int], n: int | None = None) -> Iterable[int]:
    """The `dict.get` default for each key (or for n of them)."""
    return itertools.repeat(0, len(keys) if n is None else n)
