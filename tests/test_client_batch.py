"""kvsched.client.batch: a SessionRequest.batch assembled from its submits' serialized single
messages is the message protobuf itself builds (parsed back field by field), runs of submits
stay within the daemon's announced size, and the announcement is read from the metadata."""

from __future__ import annotations

from kvsched.client import batch
from kvsched.client.types import build_submit
from kvsched.v1 import request_service_pb2 as rpb


def _msgs(sizes: list[int]) -> list[rpb.SessionRequest]:
    return [
        build_submit(
            list(range(1, n + 1)),
            {"request_id": f"r{i}", "max_tokens": 7, "temperature": 0.5, "tenant": "t"},
            f"tag{i}",
        )
        for i, n in enumerate(sizes)
    ]


def test_the_assembled_batch_is_the_batch_protobuf_builds() -> None:
    msgs = _msgs([3, 200, 40_000])  # the last one's length needs a 3-byte varint
    raw = batch.encode([m.SerializeToString() for m in msgs])
    want = rpb.SessionRequest()
    want.batch.submits.extend([m.submit for m in msgs])
    assert rpb.SessionRequest.FromString(raw) == want
    assert raw == want.SerializeToString()


def test_groups_keep_the_order_and_each_batch_within_the_limit() -> None:
    singles = [m.SerializeToString() for m in _msgs([10, 10, 10, 300, 10, 10])]
    limit = 2 * len(singles[0]) + 16  # two small ones fit, not three; the big one alone
    runs = list(batch.groups(singles, limit))
    assert [s for run in runs for s in run] == singles
    assert [len(run) for run in runs] == [2, 1, 1, 2]
    assert all(len(batch.encode(run)) <= limit for run in runs if len(run) > 1)
    assert list(batch.groups(singles, 1 << 20)) == [singles]
    assert list(batch.groups([], 100)) == []


def test_the_limit_is_read_from_the_initial_metadata() -> None:
    assert batch.limit_from((("kvsched-session-batch", "1049600"),)) == 1049600
    assert batch.limit_from((("x", "1"), ("kvsched-session-batch", b"64"))) == 64
    assert batch.limit_from((("other", "5"),)) == 0  # an older daemon: single submits only
    assert batch.limit_from(None) == 0
    assert batch.limit_from((("kvsched-session-batch", "yes"),)) == 0
