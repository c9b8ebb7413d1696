"""Log-probabilities from vLLM's runner output, as vLLM's engine reports them.

The runner's sampler returns, per sampled token, a row of the batch's widest k + 1: the sampled
token first (its log-probability, its rank), then the top k. vLLM's output processor keeps the
first k + 1 of a row for a request that asked for k (`append_logprobs_for_next_position`); so
does `sample_rows`. Prompt log-probabilities come once, when the prompt ran
(`prompt_logprobs_dict`), one row per prompt token after the first: the daemon sends a
request that asks for them its whole prompt in one chunk (a chunk's last row needs the next
chunk's first token, which this worker would not know yet: core/kv_cache_manager.py's
`prefills_at_once`), so it never runs under runner.py's alias id.
"""

from __future__ import annotations

from typing import Any

from kvsched.core.logprobs import LogprobRow


def rows_of(
    ids: list[list[int]], lps: list[list[float]], ranks: list[int], k: int
) -> list[LogprobRow]:
    return [
        LogprobRow(lp[0], int(rank), [int(t) for t in tid[1 : k + 1]], lp[1 : k + 1])
        for tid, lp, rank in zip(ids, lps, ranks, strict=True)
    ]


def sample_rows(lists: Any, index: int, num_tokens: int, k: int) -> list[LogprobRow]:
    """The rows of the `num_tokens` tokens sampled for the request at batch `index`
    (a `LogprobsLists`)."""
    part = lists.slice_request(index, num_tokens)
    return rows_of(
        part.logprob_token_ids.tolist(),
        part.logprobs.tolist(),
        part.sampled_token_ranks.tolist(),
        k,
    )


def prompt_rows(tensors: Any, k: int) -> list[LogprobRow]:
    """The rows of a `LogprobsTensors` of prompt log-probabilities."""
    return rows_of(
        tensors.logprob_token_ids.tolist(),
        tensors.logprobs.tolist(),
        tensors.selected_token_ranks.tolist(),
        k,
    )
