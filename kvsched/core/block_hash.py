"""Chained block hashes of a request's tokens: equal hashes mean equal prefixes.

    h[i] = blake2b(h[i-1] | tokens[i*bs : (i+1)*bs] | extra_keys(i))
    extra_keys(i) = LoRA name, cache_salt (block 0 only), and for every multimodal range
                    overlapping the block: (content hash, block start - range offset)

Only full blocks are hashed. Pure (no state but the block size): the cache manager hashes with
one, and a cluster router hashes a prompt for each block size its peers use.
"""

from __future__ import annotations

import hashlib
import struct

from kvsched.core.request import Request, packed_prompt
from kvsched.core.slots import packed_output


def use_hashes(req: Request, hashes: list[bytes]) -> None:
    """req's chained hashes are `hashes` from now on: computed for another block size (a
    router scoring instances of several sizes), or [] to have them computed anew."""
    req.block_hashes = hashes


class BlockHasher:
    """Computes and caches (in `req.block_hashes`) the chained hashes of full blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # One precompiled packer per block size (faster than array().tobytes()).
        self._pack_block = struct.Struct(f"<{block_size}q").pack

    def block_extra_keys(self, req: Request, i: int) -> bytes:
        if not (req.lora_name or req.cache_salt or req.mm_ranges):
            return b""  # the common case, on the decode hot path
        bs = self.block_size
        start, end = i * bs, (i + 1) * bs
        parts = []
        if req.lora_name:
            parts.append(f"lora={req.lora_name}")
        if i == 0 and req.cache_salt:
            parts.append(f"salt={req.cache_salt}")
        for r in req.mm_ranges:
            if r.offset < end and r.offset + r.length > start:
                parts.append(f"mm={r.content_hash}@{start - r.offset}")
        return "\x1f".join(parts).encode()

    def hash_block(self, parent: bytes, tokens: list[int], extra: bytes) -> bytes:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(self._pack_block(*tokens))
        h.update(extra)
        return h.digest()

    def ensure_hashes(self, req: Request, num_blocks: int) -> None:
        """Extend req.block_hashes to cover its first `num_blocks` full blocks (tokens known)."""
        bs, hashes = self.block_size, req.block_hashes
        p = len(req.prompt_token_ids)
        num_blocks = min(num_blocks, (p + len(req.output_token_ids)) // bs)
        k = len(hashes)
        if k >= num_blocks:
            return
        if not (req.lora_name or req.cache_salt or req.mm_ranges):
            # No extra keys (the common case, and the decode path): a tight loop. Output blocks
            # a placed request decoded lately are read from its slot's ring as packed bytes
            # (the same bytes `pack` makes), without touching 64 Python ints per block; so are
            # the prompt blocks of a request that came with its packed prompt (`prompt_array`).
            parent = hashes[-1] if hashes else b""
            blake2b = hashlib.blake2b
            start, end = k * bs, num_blocks * bs
            data = packed_output(req, start - p, end - p) if start >= p else None
            if data is None and end <= p:  # prompt blocks of a request off the wire: packed
                data = packed_prompt(req, start, end)
            if data is None:
                pack = self._pack_block
                tokens = req.token_ids(start, end)
                data = b"".join([pack(*tokens[j : j + bs]) for j in range(0, len(tokens), bs)])
            width = 8 * bs  # bytes per block
            for j in range(0, len(data), width):
                parent = blake2b(parent + data[j : j + width], digest_size=16).digest()
                hashes.append(parent)
            return
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            tokens = req.token_ids(i * bs, (i + 1) * bs)
            hashes.append(self.hash_block(parent, tokens, self.block_extra_keys(req, i)))
