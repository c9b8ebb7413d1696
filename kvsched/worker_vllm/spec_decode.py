"""Speculative decoding through vLLM's own spec-decode path, with kvsched's drafts.

The worker engine proposes the drafts (ngram prompt lookup, `worker_stub/tokens.py`) and puts
them after the handle's last token in its SeqWork (`num_draft` of them). Here they become the
step's `scheduled_spec_decode_tokens` (the request's scheduled tokens still count them), so
vLLM's runner computes their KV, samples every position and verifies them with its rejection
sampler: a request's sampled tokens are the accepted drafts and one bonus token, as the engine
expects. The runner is built with an ngram speculative config only so that it has that path
(and its rejection sampler); the drafts its own proposer makes are never taken.
"""

from __future__ import annotations

from typing import Any

from kvsched.worker_stub.executor import SeqWork


def vllm_config(num_speculative_tokens: int) -> dict[str, Any]:
    """EngineArgs.speculative_config for a runner that verifies up to this many drafts."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}


def split(w: SeqWork, drafts: dict[str, list[int]]) -> int:
    """The SeqWork's tokens that are not drafts (how many); its drafts go into `drafts` under
    its request id."""
    n = len(w.token_ids)
    if not w.num_draft:
        return n
    drafts[w.req_id] = list(w.token_ids[n - w.num_draft :])
    return n - w.num_draft
