"""Speculative decoding through vLLM's own spec-decode path, with kvsched's drafts.

The worker engine proposes the drafts and puts them after the handle's last token in its
SeqWork (`num_draft` of them). Here they become the step's `scheduled_spec_decode_tokens` (the
request's scheduled tokens still count them), so vLLM's runner computes their KV, samples every
position and verifies them with its rejection sampler: a request's sampled tokens are the
accepted drafts and one bonus token, as the engine expects.

Two drafters:

- ngram (default): the engine's prompt lookup (`worker_stub/tokens.py`). The runner is built
  with an ngram speculative config only so that it has that path (and its rejection sampler);
  the drafts its own proposer makes are never taken.
- a draft model (`--draft-model DIR`, vLLM's method "draft_model"): a second, smaller model of
  the same vocabulary loaded into the same runner. After each step vLLM's DraftModelProposer
  runs it over the step's tokens (writing the draft model's KV into the request's own blocks:
  its layers are more layers of the same KV cache) and proposes the next K drafts; `ModelDrafts`
  keeps them per request and puts them into the request's next decode. The engine only reserves
  the draft positions (`reserve`: how many follows the engine's room rules, the same as for
  ngram), so acceptance is counted and reported exactly as for ngram drafts. A request with no
  proposal yet (its first decode right after a placement whose prompt this runner did not
  compute: a full prefix hit, a prefill/decode hand-off) verifies placeholder drafts (token 0):
  almost always rejected, never wrong. A preempted request's draft state is rebuilt as its KV is:
  its recompute runs the draft model over the same tokens (its proposals are dropped with it).

Either way the texts equal plain greedy decoding: the target model verifies every draft.

vLLM 0.32's CPU build gives wrong tokens when a speculative step mixes greedy and
random-sampling requests: its own `LLM.generate` with ngram or draft-model speculation, greedy
requests beside seeded temperature-1 ones, gave 0 of 6 greedy texts equal to plain greedy
(tokens such as 0, 1, 2 after drafts), and kvsched's worker gave 8 of 12. So a step that runs
any non-greedy request verifies no drafts (`no_drafts_unless_greedy`): plain sampling that step.
"""

from __future__ import annotations

from typing import Any

from kvsched.worker_stub.executor import SeqWork

PLACEHOLDER = 0  # a reserved draft position the runner has no proposal for


def vllm_config(num_speculative_tokens: int, draft_model: str = "") -> dict[str, Any]:
    """EngineArgs.speculative_config for a runner that verifies up to this many drafts (with
    `draft_model`, a model directory: vLLM's draft-model proposer on it)."""
    if draft_model:
        return {
            "method": "draft_model",
            "model": draft_model,
            "num_speculative_tokens": num_speculative_tokens,
        }
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}


def num_to_propose(facts: Any) -> int:
    """SchedulerOutput.num_spec_tokens_to_schedule: drafts the runner's own proposer makes after
    the step (the draft model's K; at 0 it proposes nothing: ngram drafts are the engine's)."""
    return int(facts.num_speculative_tokens) if facts.draft_model else 0


def reserve(history: list[int], k: int) -> list[int]:
    """The engine's DraftFn with a draft model: k placeholder drafts that `ModelDrafts` fills."""
    return [PLACEHOLDER] * k


class ModelDrafts:
    """The draft model's latest proposals, per request id (the runner's DraftTokenIds)."""

    def __init__(self) -> None:
        self._proposed: dict[str, list[int]] = {}
        self.num_filled = 0  # draft positions filled with a proposal (the rest: placeholders)

    def __len__(self) -> int:
        return len(self._proposed)

    def fill(self, w: SeqWork) -> list[int]:
        """w's drafts: the request's proposal (its first num_draft tokens) where there is one,
        the engine's own after it (all of them without a draft model: nothing is proposed)."""
        n = len(w.token_ids)
        got = self._proposed.get(w.req_id, [])[: w.num_draft]
        self.num_filled += len(got)
        return got + list(w.token_ids[n - w.num_draft + len(got) :])

    def update(self, taken: Any, work: list[SeqWork]) -> None:
        """Keep the proposals the runner made this step (`taken`: its take_draft_token_ids(),
        None when it made none) for the requests that sampled in it (`work`: the step's)."""
        if taken is None:
            return
        sampled = {w.req_id for w in work if w.sample}
        for req_id, ids in zip(taken.req_ids, taken.draft_token_ids, strict=True):
            if req_id in sampled:
                self._proposed[req_id] = [int(t) for t in ids]

    def drop(self, req_id: str) -> None:
        self._proposed.pop(req_id, None)

    def clear(self) -> None:
        self._proposed.clear()


def no_drafts_unless_greedy(work: list[SeqWork], reqs: dict[str, Any]) -> bool:
    """When any of the step's requests (`reqs`: the executor's by request
    id, with vLLM's SamplingParams as `.params`) samples at random, take the drafts off every SeqWork (num_draft 0: the engine
    then counts none) and return True; the step runs without speculation."""
    from vllm.sampling_params import SamplingType

    if all(reqs[w.req_id].params.sampling_type == SamplingType.GREEDY for w in work):
        return False
    for w in work:
        if w.num_draft:
            del w.token_ids[len(w.token_ids) - w.num_draft :]
            w.num_draft = 0
    return True


def split(w: SeqWork, drafts: dict[str, list[int]], model: ModelDrafts | None = None) -> int:
    """The SeqWork's tokens that are not drafts (how many); its drafts (filled from `model`'s
    proposals) go into `drafts` under its request id."""
    n = len(w.token_ids)
    if not w.num_draft:
        return n
    drafts[w.req_id] = model.fill(w) if model is not None else list(w.token_ids[n - w.num_draft :])
    return n - w.num_draft
