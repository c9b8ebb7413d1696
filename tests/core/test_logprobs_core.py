"""Log-probabilities in the core (issue 35): a request still owed its prompt log-probabilities
computes its whole prompt in one step and takes no prefix hit (a chunk's last position needs
the next chunk's first token, which the worker does not know yet); a prompt longer than a step
is refused naming the field; a report's rows land on the request by output position, the
prompt's once; a request that did not ask has no rows at all."""

from __future__ import annotations

import pytest

from kvsched.core import InvalidRequest
from kvsched.core.logprobs import LogprobRow, TokenLogprobs
from kvsched.core.protocol import SamplingParams
from kvsched.core.request import Request
from tests.core.factories import make_request, make_scheduler, report, run_tasks

ROW = LogprobRow(-0.5, 2, [3, 4], [-0.25, -0.5])
PROMPT = list(range(1000, 1060))


def _asking(prompt: list[int], rid: str, **k: int) -> Request:
    sp = SamplingParams(max_tokens=4, ignore_eos=True, **k)  # type: ignore[arg-type]
    return Request(rid, list(prompt), sp)


def test_prompt_logprobs_prefill_in_one_step_without_a_prefix_hit() -> None:
    s = make_scheduler(max_num_batched_tokens=96, long_prefill_token_threshold=16)
    warm = make_request(PROMPT, max_tokens=2)  # caches the prompt's blocks
    s.add_request(warm)
    while warm.num_computed_tokens < len(PROMPT):
        run_tasks(s, s.schedule())
    plain = make_request(PROMPT + [9], max_tokens=2)
    asks = _asking(PROMPT + [9], "asks", prompt_logprobs=2)
    s.add_request(plain)
    s.add_request(asks)
    tasks = s.schedule()
    chunks = {s.live[c.handle].req_id: c for c in tasks.chunks}
    assert chunks["asks"].start == 0 and len(chunks["asks"].token_ids) == len(PROMPT) + 1
    assert chunks[plain.req_id].start == 48  # the plain one hit the cached blocks
    # (the asking one's 61 tokens in one chunk, over long_prefill_token_threshold's 16)
    s.check_integrity()
    with pytest.raises(InvalidRequest, match="prompt_logprobs: a prompt of 97 tokens"):
        s.add_request(_asking(list(range(97)), "long", prompt_logprobs=0))
    s.add_request(_asking(list(range(97)), "long-ok", logprobs=1))  # output ones: any length


def test_report_rows_land_by_position_and_the_prompts_once() -> None:
    s = make_scheduler()
    asks, plain = _asking([5, 6, 7], "a", logprobs=2, prompt_logprobs=1), make_request(3)
    assert plain.logprobs is None and asks.logprobs is not None
    for r in (asks, plain):
        s.add_request(r)
    s.schedule()
    rep = report(s, [(asks.handle, 3, [11]), (plain.handle, 3, [12])])
    rep.num_logprobs, rep.logprobs = [1, 0], TokenLogprobs.of([ROW])
    rep.prompt_logprob_handles, rep.num_prompt_logprobs = [asks.handle], [2]
    rep.prompt_logprobs = TokenLogprobs.of([ROW, ROW])
    s.apply_report(rep)
    rep = report(s, [(asks.handle, 4, [13])])  # a second prompt report (a re-run): ignored
    rep.num_logprobs, rep.logprobs = [1], TokenLogprobs.of([ROW._replace(rank=1)])
    rep.prompt_logprob_handles, rep.num_prompt_logprobs = [asks.handle], [1]
    rep.prompt_logprobs = TokenLogprobs.of([ROW])
    s.apply_report(rep)
    assert asks.output_token_ids == [11, 13]
    assert asks.logprobs.rows(0, 2) == [ROW, ROW._replace(rank=1)]
    assert asks.logprobs.prompt == [ROW, ROW]
    s.check_integrity()
