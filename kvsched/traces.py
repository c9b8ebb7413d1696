"""Real request traces for replay and benchmarks (the shipped slices: kvsched/data/README.md).

- Mooncake `*.jsonl`: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`. Each hash
  id stands for one 512-token block of the prompt; equal ids are equal prefixes. A hash id's
  tokens are a counter-based hash of (id, offset) (`block_tokens`), so requests that share ids share
  those tokens exactly; the last block holds input_length - 512 * (len(hash_ids) - 1) tokens.
- Azure LLM inference `*.csv`: `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as
  datetime strings. No hash ids: every request gets tokens of its own.

Rows are read in file order, which is arrival order in the shipped traces; arrivals are seconds
from the first row.
"""

from __future__ import annotations

import csv
import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

HASH_BLOCK_SIZE = 512  # prompt tokens per Mooncake hash id
_UNIQUE_KEYS = 1 << 50  # hash-less requests: keys far above any Mooncake id, x512 fits 64 bits

U64Array = npt.NDArray[np.uint64]
# (arrival_s, input_length, output_length, hash_ids) of one row
_Row = tuple[float, int, int, list[int]]


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds after the trace's first request
    prompt_token_ids: list[int]
    max_tokens: int
    hash_ids: list[int] = field(default_factory=list)  # Mooncake only


def load_trace(
    path: str | Path,
    duration_s: float | None = None,
    max_requests: int | None = None,
    vocab_size: int = 32000,
) -> list[TraceRequest]:
    """The requests of a trace file arriving before `duration_s`, at most `max_requests` of them,
    with token ids in [0, vocab_size). Raises ValueError for an unknown suffix or a bad row."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = _mooncake_rows(path)
    elif path.suffix == ".csv":
        rows = _azure_rows(path)
    else:
        raise ValueError(f"{path}: trace files are *.jsonl (Mooncake) or *.csv (Azure)")
    blocks = _HashBlocks(vocab_size)
    requests: list[TraceRequest] = []
    for index, (arrival_s, num_input, num_output, hash_ids) in enumerate(rows):
        if max_requests is not None and len(requests) >= max_requests:
            break
        if duration_s is not None and arrival_s >= duration_s:
            break
        if hash_ids:
            prompt = blocks.prompt(hash_ids, num_input)
        else:
            prompt = unique_tokens(index, num_input, vocab_size)
        requests.append(TraceRequest(arrival_s, prompt, max(1, num_output), hash_ids))
    return requests


class _HashBlocks:
    """The 512 tokens of each hash id, generated once per id and shared between prompts."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokens: dict[int, list[int]] = {}

    def prompt(self, hash_ids: list[int], num_tokens: int) -> list[int]:
        if len(hash_ids) != -(-num_tokens // HASH_BLOCK_SIZE):
            raise ValueError(f"{len(hash_ids)} hash ids for a prompt of {num_tokens} tokens")
        new = [h for h in dict.fromkeys(hash_ids) if h not in self._tokens]
        if new:
            rows = block_tokens(np.array(new, dtype=np.uint64), self.vocab_size).tolist()
            self._tokens.update(zip(new, rows, strict=True))
        prompt: list[int] = []
        for hash_id in hash_ids[:-1]:
            prompt += self._tokens[hash_id]
        prompt += self._tokens[hash_ids[-1]][: num_tokens - len(prompt)]
        return prompt


def unique_tokens(index: int, num_tokens: int, vocab_size: int) -> list[int]:
    """Tokens of a request without hash ids: shared with no other request of its trace."""
    num_blocks = -(-num_tokens // HASH_BLOCK_SIZE)
    keys = np.arange(num_blocks, dtype=np.uint64) + np.uint64(_UNIQUE_KEYS + (index << 20))
    tokens: list[int] = block_tokens(keys, vocab_size).ravel()[:num_tokens].tolist()
    return tokens


def block_tokens(keys: U64Array, vocab_size: int) -> U64Array:
    """The 512 tokens of each key (uint64 array): a counter-based hash (splitmix64) of
    (key, offset), so a key's tokens never depend on which other keys were drawn."""
    offsets = np.arange(HASH_BLOCK_SIZE, dtype=np.uint64)
    x: U64Array = keys[:, None] * np.uint64(HASH_BLOCK_SIZE) + offsets
    x += np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    tokens: U64Array = x % np.uint64(vocab_size)
    return tokens


def _mooncake_rows(path: Path) -> Iterator[_Row]:
    first_ms: float | None = None
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ms, num_input, num_output = (
                    row["timestamp"],
                    row["input_length"],
                    row["output_length"],
                )
                hash_ids = list(row["hash_ids"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row: {e}") from e
            first_ms = ms if first_ms is None else first_ms
            yield (ms - first_ms) / 1000.0, int(num_input), int(num_output), hash_ids


def _azure_rows(path: Path) -> Iterator[_Row]:
    first: datetime | None = None
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: expected header TIMESTAMP,ContextTokens,GeneratedTokens")
        for line_no, row in enumerate(reader, 2):
            try:
                when = parse_azure_timestamp(row[0])
                num_input, num_output = int(row[1]), int(row[2])
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{line_no}: not an Azure trace row: {e}") from e
            first = when if first is None else first
            yield (when - first).total_seconds(), num_input, num_output, []


def parse_azure_timestamp(text: str) -> datetime:
    """'2023-11-16 18:17:03.9799600' (7 fractional digits) -> datetime, to the microsecond."""
    base, _, frac = text.strip().partition(".")
    when = datetime.fromisoformat(base)
    return when.replace(microsecond=int((frac + "000000")[:6])) if frac else when


def ideal_lru_hit_rate(
    requests: Iterable[TraceRequest], num_blocks: int | None, block_size: int
) -> float:
    """Prompt tokens an ideal LRU prefix cache of `num_blocks` blocks (None: unbounded) would hit,
    over all prompt tokens, serving the requests one at a time in order (`ideal_lru_hits`)."""
    num_hit = num_total = 0
    for hit, total in ideal_lru_hits(requests, num_blocks, block_size):
        num_hit += hit
        num_total += total
    return num_hit / num_total if num_total else 0.0


def ideal_lru_hits(
    requests: Iterable[TraceRequest], num_blocks: int | None, block_size: int
) -> Iterator[tuple[int, int]]:
    """Per request, in order: (prompt tokens an ideal LRU prefix cache of `num_blocks` blocks
    (None: unbounded) holds when it arrives, its prompt tokens).

    Blocks are keyed by chained hashes of full blocks of the token prefix; a hit is the longest
    cached run of leading blocks, but at most (n - 1) // block_size blocks of an n-token prompt
    (a full hit still recomputes its last block). After each request all its full blocks are
    used, head last, so the LRU end holds chain tails. Ideal: running requests hold no blocks.
    """
    if block_size < 1 or (num_blocks is not None and num_blocks < 0):
        raise ValueError(
            f"need block_size >= 1 and num_blocks >= 0, got {block_size}, {num_blocks}"
        )
    lru: OrderedDict[int, None] = OrderedDict()
    for request in requests:
        tokens = request.prompt_token_ids
        keys = block_keys(tokens, block_size)
        limit = (len(tokens) - 1) // block_size
        k = 0
        while k < limit and keys[k] in lru:
            k += 1
        yield k * block_size, len(tokens)
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while num_blocks is not None and len(lru) > num_blocks:
            lru.popitem(last=False)


def block_keys(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: key i names the whole prefix up to block i."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys
