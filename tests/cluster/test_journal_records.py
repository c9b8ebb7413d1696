"""The journal's records (kvsched/durability/records.py), pure: subject tokens for any request
id, token batches split under the payload limit and applied back, gaps ignored until a
compaction repairs them."""

from __future__ import annotations

from kvsched.durability import records as R
from kvsched.v1 import request_service_pb2 as rpb


def test_any_request_id_is_one_subject_token_and_round_trips() -> None:
    for rid in ("a", "with.dots", "with space", "*", ">", "ünïcode", "x" * 300, ""):
        tok = R.id_token(rid)
        assert tok == "" or all(c.isalnum() or c in "-_" for c in tok)
        assert R.id_from_token(tok) == rid
        assert R.req_subject("d1", rid).count(".") == R.REQ.count(".") + 2


def test_batches_split_under_the_limit_and_apply_back_in_order() -> None:
    big = list(range(R.MAX_BATCH_TOKENS - 10))
    entries = [("a", 0, big), ("b", 0, [1, 2, 3]), ("c", 0, list(range(50)))]
    msgs = R.token_batches(entries)
    assert len(msgs) == 2  # "a" alone fills one message; an entry is never split
    tokens = {"a": [], "b": [], "c": []}
    for m in msgs:
        R.apply_batch(tokens, m)
    assert tokens == {"a": big, "b": [1, 2, 3], "c": list(range(50))}
    # deltas continue where each request is; an unknown id is ignored
    for m in R.token_batches([("b", 3, [4, 5]), ("zz", 0, [9])]):
        R.apply_batch(tokens, m)
    assert tokens["b"] == [1, 2, 3, 4, 5] and "zz" not in tokens


def test_a_gap_is_ignored_and_a_full_rewrite_repairs_it() -> None:
    tokens: dict[str, list[int]] = {"r": [7, 8]}
    (gap,) = R.token_batches([("r", 5, [1, 1])])  # positions 2-4 were lost
    R.apply_batch(tokens, gap)
    assert tokens["r"] == [7, 8]
    (full,) = R.token_batches([("r", 0, [7, 8, 9, 10, 11, 1, 1])])
    R.apply_batch(tokens, full)
    assert tokens["r"] == [7, 8, 9, 10, 11, 1, 1]


def test_records_round_trip() -> None:
    pb = rpb.GenerateRequest(prompt_token_ids=[1, 2, 3], detachable=True)
    rec = R.parse_record(R.accepted_record(pb, "id1", "d1", "i0", "p", "tag"))
    assert rec.kind == R.ACCEPTED and rec.request.request_id == "id1"
    assert list(rec.request.prompt_token_ids) == [1, 2, 3] and rec.request.detachable
    assert (rec.daemon_id, rec.instance, rec.principal, rec.client_tag) == ("d1", "i0", "p", "tag")
    fin = rpb.Finished(request_id="id1", message="m")
    done = R.parse_record(R.finished_record("id1", "d1", "p", [5, -1, 2**31 - 1], fin))
    assert done.kind == R.FINISHED and R.finished_tokens(done) == [5, -1, 2**31 - 1]
    assert done.finished.message == "m"
