"""The `model` executor's multimodal encoder and its cache (the worker's side of the daemon's
kvsched/core/encoder_cache.py).

The encoder is a deterministic stand-in: an item's output is `length` embeddings drawn from a
generator seeded by its content hash and the model seed, at the token embeddings' scale. The
transformer reads them in place of the token embeddings at the item's placeholder positions,
so using another item's output, or none, changes tokens.

`EncoderOutputs` keeps what was encoded until the daemon names the item in
`Tasks.encoder_drops` (or resets the prefix cache). It counts encodes and hits: the daemon
charges its encoder budget once per miss, so on a run without resets or preemptions the
worker encodes exactly as often as the daemon counted misses; a worker that kept an item the
daemon dropped would encode less (`keep_dropped` is that fault, for the proof that the check
can fail). Imports numpy only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from kvsched.core.protocol import MultimodalRange


def encode_item(content_hash: str, length: int, hidden: int, seed: int, std: float) -> np.ndarray:
    """The stand-in encoder: [length, hidden] float64 embeddings of one item."""
    digest = hashlib.sha256(content_hash.encode()).digest()
    rng = np.random.default_rng([seed, 0x454E43, int.from_bytes(digest[:8], "little")])
    return rng.standard_normal((length, hidden)) * std


class EncoderOutputs:
    """Encoder outputs by content hash, kept until dropped."""

    def __init__(self, hidden: int, seed: int, std: float) -> None:
        self.hidden, self.seed, self.std = hidden, seed, std
        self.items: dict[str, np.ndarray] = {}
        self.encodes = 0  # items encoded (not found here when a chunk needed them)
        self.hits = 0  # chunks that found their item here
        self.drops = 0  # items dropped because a Tasks message named them
        self.keep_dropped = False  # fault injection (tests): ignore encoder_drops

    @property
    def used(self) -> int:
        """Embeddings held."""
        return sum(len(v) for v in self.items.values())

    def get(self, content_hash: str, length: int) -> np.ndarray:
        out = self.items.get(content_hash)
        if out is not None and len(out) == length:
            self.hits += 1
            return out
        out = encode_item(content_hash, length, self.hidden, self.seed, self.std)
        self.items[content_hash] = out
        self.encodes += 1
        return out

    def drop(self, hashes: list[str]) -> None:
        if self.keep_dropped:
            return
        for h in hashes:
            if self.items.pop(h, None) is not None:
                self.drops += 1

    def clear(self) -> None:
        self.items.clear()


Lookup = Callable[[str, int], np.ndarray]
# One sequence of a step: (its first row in the flat batch, first position, positions, items)
Span = tuple[int, int, int, Sequence[MultimodalRange]]


def placeholder_rows(spans: Sequence[Span], lookup: Lookup) -> tuple[np.ndarray, np.ndarray] | None:
    """The flat batch rows that lie in an item's placeholder range and the encoder embeddings
    they take instead of their token's (None: no such row). `lookup(hash, length)` gives an
    item's output (a cache, or the encoder itself)."""
    index: list[np.ndarray] = []
    rows: list[np.ndarray] = []
    for row0, start, n, ranges in spans:
        end = start + n
        for r in ranges:
            lo, hi = max(start, r.offset), min(end, r.offset + r.length)
            if lo >= hi:
                continue
            out = lookup(r.content_hash, r.length)
            index.append(np.arange(row0 + lo - start, row0 + hi - start))
            rows.append(out[lo - r.offset : hi - r.offset])
    if not index:
        return None
    return np.concatenate(index), np.concatenate(rows)
