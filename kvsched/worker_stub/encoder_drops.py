"""The engine's check of `Tasks.encoder_drops` (see the WorkerService comment, step 4).

The daemon tracks which multimodal items' encoder outputs the worker holds
(kvsched/core/encoder_cache.py) and drops only items no queued chunk of a held handle reads. A
drop that names such an item means its accounting went wrong: the worker refuses it
(ProtocolError) instead of quietly re-encoding. Imports the core's protocol types only.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import MultimodalRange

# (handle, its items, its queued chunks: start -> token ids)
Held = tuple[int, list[MultimodalRange], dict[int, list[int]]]


def check_encoder_drops(held: Iterable[Held], hashes: list[str]) -> None:
    """Raise ProtocolError when a dropped item is read by a queued chunk of a held handle."""
    drop = set(hashes)
    for handle, ranges, chunks in held:
        for r in ranges:
            if r.content_hash not in drop:
                continue
            for start, tokens in chunks.items():
                if start < r.offset + r.length and start + len(tokens) > r.offset:
                    raise ProtocolError(
                        f"encoder_drops names item {r.content_hash!r}, which a queued chunk "
                        f"(at {start}) of handle {handle} reads"
                    )
