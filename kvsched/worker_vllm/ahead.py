"""A step launched ahead: the vLLM worker keeps vLLM's model runner one step ahead of kvsched's
step loop, as vLLM's async scheduling keeps it ahead of vLLM's own scheduler.

Without it, vLLM's worker process waits while this process takes a step's tokens, checks stops,
reports to the daemon and builds the next step: at batch 1 on the tiny model that was 1.4 of
2.9 ms a step (three shared-memory hand-offs and two thread hops), the forward pass and sampling
the other 1.5 ms. vLLM's runner appends every token it samples to its own input batch, so a
decode's input token never needs to travel: the next decode can be queued before this one's
tokens come back.

    execute(step N+1) with step N+1' launched ahead during step N:
      rows of N+1 that N+1' ran (same placement, same start, one decode or the same chunk)
        -> their tokens come from N+1'
      the other rows (a new request's chunk, a request placed since)
        -> deferred: they run in the step launched now (N+2'), and the engine offers them
           again at its next step, where N+2' covers them
      launched now, before waiting for N+1': every row of N+1 that samples, one position
        further, for requests that may go on, plus the deferred rows

What it costs: a request that stops (EOS, stop id, max_tokens when not foreseen) runs one more
decode that nobody reads (its KV lands in its own blocks, past its tokens); a new request's
first chunk joins the step after the one already queued (one step later, as with vLLM's async
scheduling). That step is cheap to wait for while steps are short; once the runner's steps take
DEFER_ENV (10 ms) or more, the rows are not deferred but sent at once as a step of their own (after
the one queued; the covered rows' next decodes follow it): an extra forward pass instead of a
whole step of waiting. Rows the runner cannot run ahead keep the synchronous path: grammar-constrained
requests (the bitmask needs the previous token) and seeded random sampling (a wasted sample
would move the seeded generator); drafts turn the mode off (`enabled`). KVSCHED_VLLM_AHEAD=0
turns it off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_vllm import env

ENV = "KVSCHED_VLLM_AHEAD"
# Rows are deferred into the next launched step only while the runner's steps (EWMA) are
# shorter than this many ms (default 10); longer steps get them as an extra step of their own.
DEFER_ENV = "KVSCHED_VLLM_DEFER_MAX_MS"
# Steps are launched ahead only after a step of at most this many rows (default 16). Measured on
# a quiet 2-core box (BENCHMARKS 19, tiny model, where the runner's child shares the cores with
# the control plane): batch 1 gains 0.55x -> 0.94x vLLM's tok/s; 16 requests +16-19 % tok/s
# (the child waited ~1.3 ms of a ~3.8 ms step for this process); 32 requests +12 % tok/s but
# TTFT p50 +50 %; 64 requests fewer rows per step (17 vs 49: new requests wait a step, and the
# control plane, sharing a core with a child that never idles, admits them later) and 0.86x
# the tok/s of one step at a time. On a GPU box the child does not take the control plane's
# core, so a higher limit may pay off there (not measured: no GPU was lent).
ROWS_ENV = "KVSCHED_VLLM_AHEAD_MAX_ROWS"
_GREEDY_EPS = 1e-5  # vLLM's: a temperature below it samples greedily


def enabled(num_speculative_tokens: int) -> bool:
    """Whether this worker launches steps ahead (ENV "1", the default, or "0"); never with
    speculative decoding (the number of tokens a step keeps is not known ahead)."""
    on = env.switch(ENV, True, "launch steps ahead", "one at a time")
    return on and not num_speculative_tokens


def defer_max_s() -> float:
    """DEFER_ENV in seconds."""
    return env.number(DEFER_ENV, "10", 1e6, "ms") / 1e3


def max_rows() -> int:
    """ROWS_ENV: launch ahead after steps of at most this many rows."""
    return int(env.number(ROWS_ENV, "16", 1 << 20, "rows", integer=True))


def runs_ahead(params: Any) -> bool:
    """Whether a request's rows may run ahead: no grammar, no seeded random sampling."""
    if params.structured_outputs is not None:
        return False
    return params.seed is None or params.temperature < _GREEDY_EPS


@dataclass(slots=True)
class Row:
    """One row of a launched step, as the engine would ask for it."""

    req: Any  # the executor's request state at launch (a re-placement makes a new one)
    start: int
    tokens: tuple[int, ...] | None  # a chunk's tokens; None for a decode (its input is the
    # runner's last sample)
    sample: bool


@dataclass(slots=True)
class Launched:
    """A step sent to vLLM's worker: its rows by request id, and the futures of its forward
    pass and sampling (vLLM answers in order)."""

    rows: dict[str, Row]
    forward: Any
    sampled: Any
    sent_at: float
    grammar: Any = None
    _result: Any = None

    def result(self) -> Any:
        """The step's ModelRunnerOutput (waits for it; None for a step without tokens)."""
        if self.forward is not None:
            self.forward.result()  # (the forward pass's error first, when it failed)
            self._result = self.sampled.result() if self.sampled is not None else None
            self.forward = self.sampled = None
        return self._result

    def covers(self, w: SeqWork, req: Any) -> bool:
        """Whether this step already ran SeqWork `w` of request state `req`."""
        row = self.rows.get(w.req_id)
        if row is None or row.req is not req or row.start != w.start or row.sample != w.sample:
            return False
        if row.tokens is None:
            return len(w.token_ids) == 1 and not w.num_draft and w.start >= req.num_prefill
        return row.tokens == tuple(w.token_ids)


def row_of(w: SeqWork, req: Any) -> Row:
    """The Row a SeqWork sent now becomes."""
    decode = w.start >= req.num_prefill and w.sample and len(w.token_ids) == 1
    return Row(req, w.start, None if decode else tuple(w.token_ids), w.sample)


def advanced(w: SeqWork, req: Any, block_size: int, max_model_len: int) -> SeqWork | None:
    """The decode after SeqWork `w` (run or launched), when its request may go on: the runner
    samples its input; None when `w` does not sample, the position lies past the blocks or the
    model's length, or the request has had all its tokens (`req.num_out` counts those queued)."""
    if not w.sample or w.num_draft:
        return None
    start = w.start + len(w.token_ids)
    if start >= len(w.block_ids) * block_size or start + 1 >= max_model_len:
        return None
    if req.num_out >= req.params.max_tokens:
        return None
    return SeqWork(w.handle, w.req_id, w.block_ids, start, [0], True, 0, w.sampling)


def now() -> float:
    return time.perf_counter()
