"""One summary of a serving run, shared by the trace replayer (kvsched replay) and the simulator,
the policy and peer benchmarks, so every tool reports the same fields computed the same way.

Per request the caller records arrival, token times and finish (`RequestRecord`); `summarize`
turns them into:

    requests, completed, duration_s, output_tokens_per_s, goodput_rps (+ slo_ttft_s, slo_tpot_s),
    ttft_s, tpot_s, itl_s, e2e_s        each {p50, p90, p99, mean}, seconds
    prefix_hit_rate                     cached prompt tokens / prompt tokens
    preemptions, num_gpu_blocks, block_size (per instance)

Definitions (those of vLLM's benchmark_serving): TTFT = first token - arrival; TPOT = (last token
- first token) / (output tokens - 1), for requests with >= 2 output tokens; ITL = gaps between
consecutive tokens of a request, pooled; e2e = finish - arrival. A request meets the SLOs when it
completed, TTFT <= slo_ttft_s and TPOT <= slo_tpot_s (a one-token request has no TPOT and meets
that half). duration_s runs from the first arrival to the last finish.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Defaults chosen for Mooncake-like traffic on H100 (long prompts: an 85k-token prefill alone
# takes ~8 s): callers that know their SLOs pass their own.
DEFAULT_SLO_TTFT_S = 5.0
DEFAULT_SLO_TPOT_S = 0.1
COMPLETED_REASONS = ("stop", "length")


@dataclass(slots=True)
class RequestRecord:
    """What a client saw of one request. Times are seconds on one clock (virtual or wall)."""

    req_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int = 0
    instance: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one entry per output token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first placement)
    num_preemptions: int = 0
    finish_reason: str = ""  # stop | length | abort | error | rejected | "" (unfinished)
    message: str = ""  # why it did not complete: the daemon's refusal or finished message
    sent_s: float | None = None  # when its submit left the client (a replay; arrival_s: due)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETED_REASONS

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


def percentile(values: Sequence[float], p: float) -> float:
    """p-th percentile (0..100) of sorted `values`, linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    pos = (len(values) - 1) * p / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """{p50, p90, p99, mean} of values; all None when there are none."""
    xs = sorted(values)
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs),
    }


def meets_slo(rec: RequestRecord, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    ttft, tpot = rec.ttft_s, rec.tpot_s
    return (
        rec.completed
        and ttft is not None
        and ttft <= slo_ttft_s
        and (tpot is None or tpot <= slo_tpot_s)
    )


def summarize(
    records: Sequence[RequestRecord],
    *,
    num_gpu_blocks: int,
    block_size: int,
    preemptions: int,
    slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
    slo_tpot_s: float = DEFAULT_SLO_TPOT_S,
    **extra: Any,
) -> dict[str, Any]:
    """The run's summary (module docstring); `extra` fields are appended as given."""
    done = [r for r in records if r.completed]
    finishes = [r.finish_s for r in done if r.finish_s is not None]
    start = min((r.arrival_s for r in records), default=0.0)
    duration = max(finishes) - start if finishes else 0.0
    num_output = sum(r.num_output_tokens for r in done)
    num_prompt = sum(r.num_prompt_tokens for r in done)
    num_cached = sum(r.num_cached_tokens for r in done)
    itl = [b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)]
    num_good = sum(1 for r in done if meets_slo(r, slo_ttft_s, slo_tpot_s))
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "duration_s": duration,
        "output_tokens_per_s": num_output / duration if duration > 0 else 0.0,
        "goodput_rps": num_good / duration if duration > 0 else 0.0,
        "goodput_frac": num_good / len(records) if records else 0.0,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "ttft_s": distribution(x for r in done if (x := r.ttft_s) is not None),
        "tpot_s": distribution(x for r in done if (x := r.tpot_s) is not None),
        "itl_s": distribution(itl),
        "e2e_s": distribution(x for r in done if (x := r.e2e_s) is not None),
        "prefix_hit_rate": num_cached / num_prompt if num_prompt else 0.0,
        "prompt_tokens": num_prompt,
        "output_tokens": num_output,
        "preemptions": preemptions,
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": block_size,
    }
    summary.update(extra)
    return summary
