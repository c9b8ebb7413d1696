"""`StorageIndex`: the keys one daemon believes the shared storage tier holds, and the keys
some instance is writing now; ONE per daemon, shared by its instances' schedulers
(`core/storage.py` explains the tier and its keys). Pure: no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

# The index forgets its least recently stored keys past this many (the store owns capacity and
# eviction: a key forgotten here is a miss, a key the store dropped a failed fetch).
DEFAULT_MAX_KEYS = 1 << 22


class StorageIndex:
    """The keys one daemon believes the shared store holds, and the keys being written."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._stored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._writing: set[str] = set()
        self.num_forgotten = 0  # keys dropped past max_keys

    def __contains__(self, key: object) -> bool:
        return key in self._stored

    def __len__(self) -> int:
        return len(self._stored)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._stored))

    def run_from(self, keys: Iterable[str]) -> list[str]:
        """The longest run of `keys` from its start that is stored."""
        stored, out = self._stored, []
        for k in keys:
            if k not in stored:
                break
            out.append(k)
        return out

    def is_writing(self, key: str) -> bool:
        return key in self._writing

    def begin_write(self, key: str) -> bool:
        """Claim a write of `key`: False when it is stored or someone is writing it."""
        if key in self._stored or key in self._writing:
            return False
        self._writing.add(key)
        return True

    def end_write(self, key: str, ok: bool) -> None:
        """A claimed write was acknowledged (ok) or failed / dropped."""
        self._writing.discard(key)
        if ok:
            self.add([key])

    def add(self, keys: Iterable[str]) -> None:
        """Keys stored (an acknowledged write, here or at a peer daemon)."""
        stored = self._stored
        for k in keys:
            stored[k] = None
            stored.move_to_end(k)
        while len(stored) > self.max_keys:
            stored.popitem(last=False)
            self.num_forgotten += 1

    def discard(self, keys: Iterable[str]) -> None:
        """Keys no longer believed stored (a failed fetch, here or at a peer daemon)."""
        for k in keys:
            self._stored.pop(k, None)

    def clear(self) -> None:
        self._stored.clear()

    def recent(self, prefix: str, limit: int) -> list[str]:
        """The `limit` most recently stored keys that start with `prefix` (newest first): what
        a snapshot tells a restarted peer (its own index of the store starts empty)."""
        out: list[str] = []
        if limit <= 0:
            return out
        for k in reversed(self._stored):
            if k.startswith(prefix):
                out.append(k)
                if len(out) >= limit:
                    break
        return out
