"""Multimodal prompts in admission, as plain functions: where a chunk or a prefix hit may end
around image ranges, and what a chunk costs the step's encoder budget.

- `disable_chunked_mm_input`: no chunk and no prefix hit ends inside an item's range (a hit
  rolls back to the block boundary at or before the range start, like the seed's
  revert_chunked_mm_input).
- The encoder budget (`max_num_encoder_tokens`; -1 left: unlimited) bounds a step's items.
  Without the encoder cache every multimodal position a chunk reads pays; with it only misses
  pay (the whole item, encoded at once; one larger than the budget runs alone in a step) and
  a miss needs room in the cache.

Imported by `admission` only; reads the encoder cache, writes it only through `use`.
"""

from __future__ import annotations

from kvsched.core.config import SchedulerConfig
from kvsched.core.encoder_cache import EncoderCache, Needed
from kvsched.core.request import Request


def trim_chunk(
    req: Request,
    start: int,
    n: int,
    enc_left: int,
    sc: SchedulerConfig,
    enc: EncoderCache | None,
    needed: Needed,
) -> int:
    """The tokens of req's chunk [start, start + n) that may run this step: never ending
    inside an image range (disable_chunked_mm_input) and keeping the step's multimodal tokens
    within `enc_left` (-1: unlimited) by rolling back to the range start. `needed`: which
    running requests need an item (the placement table's `enc_needed`)."""
    end = start + n
    missed: dict[str, int] = {}  # the chunk's misses so far and their sizes
    touched: set[str] = set()  # every item the chunk reads: none is evicted for it
    for r in req.mm_ranges:
        r_end = r.offset + r.length
        if r_end <= start or r.offset >= end:
            continue
        if sc.disable_chunked_mm_input and r.offset < end < r_end:
            end = max(r.offset, start)
            break
        if enc is not None:
            h = r.content_hash
            if h in enc or h in missed:
                touched.add(h)
                continue
            full = sc.max_num_encoder_tokens
            if enc_left >= 0 and r.length > enc_left and not (enc_left == full and not missed):
                end = max(r.offset, start)
                break
            if not enc.can_fit(sum(missed.values()) + r.length, needed, touched):
                end = max(r.offset, start)
                break
            missed[h] = r.length
            touched.add(h)
            enc_left -= r.length if enc_left >= 0 else 0
            continue
        used = min(r_end, end) - max(r.offset, start)
        if enc_left >= 0 and used > enc_left:
            end = max(r.offset, start)
            break
        enc_left -= used if enc_left >= 0 else 0
    return end - start


def charge_encoder(
    req: Request, start: int, end: int, enc_left: int, enc: EncoderCache | None, needed: Needed
) -> int:
    """The encoder budget left (-1: unlimited) once req's chunk [start, end) is sent; with the
    cache, the items it reads are used (misses inserted) and only misses pay."""
    if enc is not None:  # the items the chunk reads: misses pay, hits are free
        ranges = [r for r in req.mm_ranges if r.offset < end and r.offset + r.length > start]
        # Hits first: once this request uses them, no miss below evicts them (as sized).
        ranges.sort(key=lambda r: r.content_hash not in enc)
        for r in ranges:
            miss = enc.use(req, r.content_hash, r.length, needed)
            if miss and enc_left >= 0:  # (a lone larger item leaves 0)
                enc_left = max(0, enc_left - r.length)
        return enc_left
    if enc_left < 0:
        return enc_left
    for r in req.mm_ranges:
        enc_left -= max(0, min(r.offset + r.length, end) - max(r.offset, start))
    return enc_left


def trim_hit(req: Request, num_hit: int, block_size: int, sc: SchedulerConfig) -> int:
    """A prefix hit may not end inside an image range when chunked mm input is disabled:
    roll it back to the block boundary at or before the range start."""
    if not (req.mm_ranges and sc.disable_chunked_mm_input):
        return num_hit
    for r in sorted(req.mm_ranges, key=lambda r: r.offset, reverse=True):
        if r.offset < num_hit < r.offset + r.length:
            num_hit = (r.offset // block_size) * block_size
    return num_hit
