"""Log-probabilities as data: a run of tokens' rows as the wire carries them (`TokenLogprobs`,
columnar) and a request's rows received so far (`RequestLogprobs`, by output position).

Only a request whose SamplingParams asks (`logprobs` / `prompt_logprobs` set) has a
`RequestLogprobs`; nothing else pays anything. The engine's sampler computes the values (the
vLLM worker takes vLLM's `LogprobsTensors`); the core only keeps them next to the tokens they
belong to, by position, so a token the daemon drops (past max_tokens, after an abort) takes its
row with it and a recomputed token's row replaces the old one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class LogprobRow(NamedTuple):
    """One token: its log-probability and rank (1 = most likely), then the top alternatives
    (most likely first). `rank` 0: no values (a token recovered without its row)."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


EMPTY_ROW = LogprobRow(0.0, 0, [], [])


@dataclass(slots=True)
class TokenLogprobs:
    """Rows of a run of tokens, columnar (common.proto's TokenLogprobs): row i has logprobs[i],
    ranks[i] and num_top[i] alternatives, stored consecutively in top_token_ids / top_logprobs."""

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    num_top: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def rows(self) -> list[LogprobRow]:
        out: list[LogprobRow] = []
        k = 0
        ids, lps = self.top_token_ids, self.top_logprobs
        for lp, rank, n in zip(self.logprobs, self.ranks, self.num_top, strict=True):
            out.append(LogprobRow(lp, rank, ids[k : k + n], lps[k : k + n]))
            k += n
        return out

    def extend(self, rows: list[LogprobRow]) -> None:
        for r in rows:
            self.logprobs.append(r.logprob)
            self.ranks.append(r.rank)
            self.num_top.append(len(r.top_token_ids))
            self.top_token_ids.extend(r.top_token_ids)
            self.top_logprobs.extend(r.top_logprobs)

    @classmethod
    def of(cls, rows: list[LogprobRow]) -> TokenLogprobs:
        out = cls()
        out.extend(rows)
        return out

    def split(self, counts: list[int]) -> list[list[LogprobRow]]:
        """The rows cut into consecutive runs of `counts` rows (ValueError when they do not add
        up)."""
        if sum(counts) != len(self):
            raise ValueError(f"{sum(counts)} log-probability rows named, {len(self)} sent")
        rows = self.rows()
        out, i = [], 0
        for c in counts:
            out.append(rows[i : i + c])
            i += c
        return out

    def check(self) -> str:
        """What is wrong with the columns ("" when nothing)."""
        n = len(self.logprobs)
        if len(self.ranks) != n or len(self.num_top) != n:
            return f"{n} logprobs, {len(self.ranks)} ranks, {len(self.num_top)} num_top"
        top = sum(self.num_top)
        if len(self.top_token_ids) != top or len(self.top_logprobs) != top:
            return (
                f"num_top adds up to {top}, {len(self.top_token_ids)} top_token_ids and "
                f"{len(self.top_logprobs)} top_logprobs"
            )
        return ""


@dataclass(slots=True)
class RequestLogprobs:
    """One request's rows (made when it is, from its SamplingParams; written by the report
    path, read by the daemon's sinks). `output[i]` belongs to output token i."""

    output: list[LogprobRow] = field(default_factory=list)
    prompt: list[LogprobRow] | None = None  # prompt positions 1.., once its last chunk ran

    def put(self, pos: int, rows: list[LogprobRow]) -> None:
        """Rows of output tokens pos, pos+1, ... (what was there before is replaced; a gap,
        tokens that came without rows, is filled with EMPTY_ROW)."""
        out = self.output
        if pos > len(out):
            out.extend([EMPTY_ROW] * (pos - len(out)))
        out[pos : pos + len(rows)] = rows

    def rows(self, start: int, end: int) -> list[LogprobRow]:
        """The rows of output tokens [start, end) (EMPTY_ROW for those without)."""
        got = self.output[start:end]
        if len(got) < end - start:
            got = got + [EMPTY_ROW] * (end - start - len(got))
        return got
