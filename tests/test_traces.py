"""Trace loading (Mooncake jsonl, Azure csv) and the ideal LRU prefix-cache bound."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from kvsched.data import AZURE_SLICE, CONVERSATION_SLICE
from kvsched.traces import (
    TraceRequest,
    ideal_lru_hit_rate,
    load_trace,
    parse_azure_timestamp,
)

CONVERSATION = CONVERSATION_SLICE  # the first 300 s (918 requests) of the full trace
AZURE = AZURE_SLICE
# The whole Mooncake conversation trace (12,031 rows), xz-compressed, for the one claim that
# needs all of it; tests/data/README.md says where it comes from. Not part of the package.
FULL_CONVERSATION = Path(__file__).parent / "data" / "mooncake_conversation.jsonl.xz"


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
        for t, n, o, ids in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def small_mooncake(tmp_path: Path) -> Path:
    return write_mooncake(
        tmp_path / "t.jsonl",
        [(1000, 1100, 10, [0, 1, 2]), (2500, 700, 20, [0, 3]), (3000, 1024, 0, [0, 1])],
    )


def test_mooncake_shared_ids_share_tokens(small_mooncake: Path) -> None:
    a, b, c = load_trace(small_mooncake)
    assert [len(r.prompt_token_ids) for r in (a, b, c)] == [1100, 700, 1024]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 1.5, 2.0]
    assert [r.max_tokens for r in (a, b, c)] == [10, 20, 1]  # at least one token
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512] == c.prompt_token_ids[:512]
    assert a.prompt_token_ids[:1024] == c.prompt_token_ids
    assert a.prompt_token_ids[512:700] != b.prompt_token_ids[512:]
    assert all(0 <= t < 32000 for t in a.prompt_token_ids)
    assert load_trace(small_mooncake, vocab_size=100)[0].prompt_token_ids[0] < 100


def test_mooncake_limits(small_mooncake: Path) -> None:
    assert len(load_trace(small_mooncake, duration_s=2.0)) == 2
    assert len(load_trace(small_mooncake, max_requests=1)) == 1
    assert load_trace(small_mooncake) == load_trace(small_mooncake)  # deterministic


def test_mooncake_bad_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hash ids"):
        load_trace(write_mooncake(tmp_path / "a.jsonl", [(0, 1100, 1, [0, 1])]))
    (tmp_path / "b.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:1"):
        load_trace(tmp_path / "b.jsonl")
    with pytest.raises(ValueError, match="jsonl"):
        load_trace(tmp_path / "c.txt")


def test_azure_timestamps_and_unique_tokens(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,600,10\n"
        "2023-11-16 18:17:04.0319600,300,8\n"
        "2023-11-16 18:18:00.0000000,1,1\n"
    )
    reqs = load_trace(path)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.052, 56.02004])
    assert [len(r.prompt_token_ids) for r in reqs] == [600, 300, 1]
    assert [r.max_tokens for r in reqs] == [10, 8, 1]
    assert reqs[0].prompt_token_ids[:16] != reqs[1].prompt_token_ids[:16]
    assert reqs[0].hash_ids == [] and load_trace(path) == reqs
    assert parse_azure_timestamp("2023-11-16 18:17:03").second == 3


def test_ideal_lru_hit_rate_by_hand(small_mooncake: Path) -> None:
    reqs = load_trace(small_mooncake)
    # b hits block 0; c hits block 0 only: a full hit still recomputes its last block
    assert ideal_lru_hit_rate(reqs, None, 512) == pytest.approx(1024 / (1100 + 700 + 1024))
    assert ideal_lru_hit_rate(reqs, 0, 512) == 0.0
    # one block of room is enough: tails are evicted first, so the shared head stays
    assert ideal_lru_hit_rate(reqs, 1, 512) == pytest.approx(1024 / (1100 + 700 + 1024))
    assert ideal_lru_hit_rate([], None, 16) == 0.0


def test_ideal_lru_evicts_chain_tails_first() -> None:
    a = TraceRequest(0.0, list(range(64)), 1)
    b = TraceRequest(1.0, [*range(32), *range(100, 132)], 1)
    # 4 blocks of 16 of a; 2 of room keep a's head blocks, so b hits both; 1 keeps one
    assert ideal_lru_hit_rate([a, b], 2, 16) == pytest.approx(32 / 128)
    assert ideal_lru_hit_rate([a, b], 1, 16) == pytest.approx(16 / 128)
    c = TraceRequest(2.0, [*range(100, 132), *range(32)], 1)  # shares no prefix
    assert ideal_lru_hit_rate([a, c, b], 4, 16) == 0.0  # c pushed a out
    assert ideal_lru_hit_rate([a, c, b], 6, 16) == pytest.approx(32 / 192)


def test_hit_rate_claim_on_the_conversation_trace() -> None:
    with lzma.open(FULL_CONVERSATION, "rt") as f:
        rows = [json.loads(line) for line in f]
    claim = _hash_id_hit_rate(rows)  # all 12,031 requests, at hash-id granularity
    assert claim == pytest.approx(0.374, abs=0.001)


def test_ideal_lru_reproduces_the_hash_id_hit_rate_on_the_slice() -> None:
    rows = [json.loads(line) for line in CONVERSATION.open()]
    # the token-level ideal cache reproduces the hash-id count on a prefix of the trace
    n = 300
    reqs = load_trace(CONVERSATION, max_requests=n)
    assert [len(r.prompt_token_ids) for r in reqs] == [r["input_length"] for r in rows[:n]]
    assert [r.max_tokens for r in reqs] == [r["output_length"] for r in rows[:n]]
    expected = _hash_id_hit_rate(rows[:n])
    assert expected > 0.05
    assert ideal_lru_hit_rate(reqs, None, 512) == pytest.approx(expected, abs=0.002)
    assert ideal_lru_hit_rate(reqs, None, 64) == pytest.approx(expected, abs=0.01)


def _hash_id_hit_rate(rows: list[dict[str, object]]) -> float:
    """Leading hash ids seen before, 512 tokens each, at most (n - 1) // 512 of them."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        ids, n = row["hash_ids"], row["input_length"]
        assert isinstance(ids, list) and isinstance(n, int)
        k = 0
        while k < min(len(ids), (n - 1) // 512) and ids[k] in seen:
            k += 1
        hit, total = hit + 512 * k, total + n
        seen.update(ids)
    return hit / total


def test_ideal_hit_rate_is_monotone_in_num_blocks() -> None:
    reqs = load_trace(CONVERSATION, max_requests=150)
    rates = [ideal_lru_hit_rate(reqs, n, 64) for n in (0, 16, 256, 2048, 16384, None)]
    assert rates == sorted(rates) and rates[0] == 0.0 and rates[-1] > rates[1]


def test_real_traces_load_a_minute() -> None:
    conv = load_trace(CONVERSATION, duration_s=60)
    assert len(conv) > 100 and conv[0].arrival_s == 0.0 and conv[-1].arrival_s < 60
    azure = load_trace(AZURE, duration_s=60)
    assert len(azure) > 10 and azure[-1].arrival_s < 60
    arrivals = [r.arrival_s for r in azure]
    assert arrivals == sorted(arrivals)
