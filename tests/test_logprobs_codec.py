"""Log-probability columns of the worker protocol (issue 35): a StepReport's rows survive the
codec both ways, a worker's merged report keeps num_logprobs parallel to its handles when only
some of its steps had rows, and columns that do not add up are refused naming the column. The
sampling fields travel with presence (absent: none; 0: the token's own value only)."""

from __future__ import annotations

import pytest

from kvsched import codec
from kvsched.core.logprobs import LogprobRow, RequestLogprobs, TokenLogprobs
from kvsched.core.protocol import SamplingParams, StepReport
from kvsched.v1 import worker_service_pb2 as wpb

ROWS = [LogprobRow(-0.5, 2, [3, 4], [-0.25, -0.5]), LogprobRow(-1.0, 1, [9], [-1.0])]


def _report(step: int, with_rows: bool) -> StepReport:
    r = StepReport(step=step, applied_seq=0, handles=[7, 8], num_computed=[5, 5])
    r.num_new_tokens, r.token_ids, r.finish_reasons = [1, 1], [11, 12], [0, 0]
    if with_rows:
        r.num_logprobs, r.logprobs = [1, 0], TokenLogprobs.of(ROWS[:1])
        r.prompt_logprob_handles, r.num_prompt_logprobs = [7], [2]
        r.prompt_logprobs = TokenLogprobs.of(ROWS)
    return r


def test_rows_survive_the_codec_and_absent_stays_absent() -> None:
    back = codec.report_from_proto(codec.report_to_proto(_report(1, True)))
    assert list(back.num_logprobs) == [1, 0] and back.logprobs is not None
    assert back.logprobs.rows() == ROWS[:1]
    assert back.prompt_logprob_handles == [7] and back.num_prompt_logprobs == [2]
    assert back.prompt_logprobs is not None and back.prompt_logprobs.rows() == ROWS
    plain = codec.report_to_proto(_report(2, False))
    assert not plain.HasField("logprobs") and not len(plain.num_logprobs)
    back = codec.report_from_proto(plain)
    assert back.logprobs is None and not back.num_logprobs


@pytest.mark.parametrize("first_has_rows", [True, False])
def test_a_merged_report_keeps_num_logprobs_parallel_to_handles(first_has_rows: bool) -> None:
    held = codec.report_to_proto(_report(1, first_has_rows))
    codec.merge_reports(held, codec.report_to_proto(_report(2, not first_has_rows)))
    assert len(held.num_logprobs) == len(held.handles) == 4
    back = codec.report_from_proto(held)  # accepted by the daemon's check
    want = [1, 0, 0, 0] if first_has_rows else [0, 0, 1, 0]
    assert list(back.num_logprobs) == want


@pytest.mark.parametrize(
    ("breaks", "says"),
    [
        (lambda r: r.num_logprobs.append(0), "num_logprobs for 2 handles"),
        (lambda r: r.logprobs.logprobs.append(0.0), "StepReport.logprobs"),
        (lambda r: r.logprobs.top_token_ids.append(1), "StepReport.logprobs: num_top adds up"),
        (lambda r: r.num_prompt_logprobs.append(1), "prompt_logprob_handles and num_prompt"),
    ],
)
def test_columns_that_do_not_add_up_are_refused(breaks: object, says: str) -> None:
    pb = codec.report_to_proto(_report(1, True))
    breaks(pb)  # type: ignore[operator]
    with pytest.raises(ValueError, match=says):
        codec.report_from_proto(pb)


def test_a_row_count_other_than_the_tokens_is_refused() -> None:
    pb = codec.report_to_proto(_report(1, True))
    pb.num_logprobs[1] = 1  # row 1 sampled one token; 1 is fine, but then the rows do not add up
    with pytest.raises(ValueError, match="2 rows named, 1 sent"):
        codec.report_from_proto(pb)
    pb = wpb.StepReport()
    pb.CopyFrom(codec.report_to_proto(_report(1, True)))
    pb.num_new_tokens[0] = 2
    pb.token_ids.append(13)
    with pytest.raises(ValueError, match="0 or num_new_tokens"):
        codec.report_from_proto(pb)


def test_sampling_presence_and_request_rows_by_position() -> None:
    for k in (None, 0, 5):
        sp = SamplingParams(logprobs=k, prompt_logprobs=k)
        assert codec.sampling_from_proto(codec.sampling_to_proto(sp)) == sp
    lp = RequestLogprobs()
    lp.put(2, ROWS)  # tokens 0 and 1 came without rows (recovered), 2 and 3 with
    assert lp.rows(0, 4)[2:] == ROWS and lp.rows(0, 2)[0].rank == 0
    lp.put(3, ROWS[:1])  # token 3 recomputed: its row replaced
    assert lp.rows(3, 5) == [ROWS[0], LogprobRow(0.0, 0, [], [])]
