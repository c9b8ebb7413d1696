"""The engine's per-sequence token rules: when a sequence stops (`check_stop`) and which draft
tokens to propose for speculative decoding (`ngram_draft`)."""

from __future__ import annotations

from collections.abc import Callable

from kvsched.core.protocol import FinishReason, SamplingParams

DraftFn = Callable[[list[int], int], list[int]]


def check_stop(
    sampling: SamplingParams,
    tokens: list[int],
    num_tokens: int,
    num_output: int,
    eos_token_id: int,
    max_model_len: int,
) -> tuple[int, FinishReason]:
    """How many of the newly sampled `tokens` to keep, and why the sequence stops (NONE: it
    goes on). num_tokens / num_output count the sequence before them. As vLLM v1: length
    (max_tokens, max_model_len) first; EOS and stop tokens only once min_tokens are out; the
    stopping token is kept.
    """
    for i, token in enumerate(tokens, 1):
        out = num_output + i
        if out >= sampling.max_tokens or num_tokens + i >= max_model_len:
            return i, FinishReason.LENGTH
        is_eos = token == eos_token_id and not sampling.ignore_eos
        if out >= sampling.min_tokens and (is_eos or token in sampling.stop_token_ids):
            return i, FinishReason.STOP
    return len(tokens), FinishReason.NONE


def ngram_draft(
    history: list[int], k: int, *, min_n: int = 1, max_n: int = 3, window: int = 4096
) -> list[int]:
    """Prompt-lookup drafts: find the latest earlier occurrence of the history's last n tokens
    (longest n first, within the last `window` tokens) and propose up to k tokens that followed.
    """
    tail = history[-window:]
    if k <= 0 or len(tail) < 2:
        return []
    rev = tail[::-1]  # rev[i] is tail[-1 - i]; searching rev finds the latest match first
    for n in range(min(max_n, len(tail) - 1), min_n - 1, -1):
        pattern = rev[:n]
        i = 1
        while (i := _index(rev, pattern[0], i)) >= 0:
            if rev[i : i + n] == pattern:
                return tail[len(tail) - i : len(tail) - i + k]
            i += 1
    return []


def _index(items: list[int], value: int, start: int) -> int:
    try:
        return items.index(value, start)
    except ValueError:
        return -1
