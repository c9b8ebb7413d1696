"""Several Session submits in one message (SessionRequest.batch), for a client with a burst
of them ready: the daemon reads one message per turn of its event loop, so a burst sent as
one batch is read at once instead of one submit per turn.

A daemon that takes batches says so as the stream opens, in its initial metadata
(`kvsched-session-batch: <bytes>`: the largest message it receives); a client sends batches
only after seeing it (an older daemon would answer a batch with one error naming no submit,
and never run them) and keeps each batch within that size (a larger message would end the
whole stream with RESOURCE_EXHAUSTED).

A batch is assembled from its submits' serialized single messages, without copying or
re-encoding them: SessionRequest{submit = s} is field 1 of SessionRequest, and a SubmitBatch's
`submits` is field 1 of SubmitBatch, so the bytes of SubmitBatch{submits = [s1, s2, ...]} are
the concatenation of the bytes of SessionRequest{submit = s1}, SessionRequest{submit = s2},
... (the protobuf wire format: a repeated message field is its elements' records one after
another), and SessionRequest{batch = b} is field 3's record around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

HEADER = "kvsched-session-batch"
# A longer burst goes in several batches of about this size: the daemon starts on the first
# while the next is on its way (in one message, its first request waits for the whole
# transfer: 16 requests of the Mooncake trace, 287k prompt tokens, ~1 MB, were accepted
# 26-35 ms after the send in one message, the first 9-12 ms after in 256 KiB parts; noisy box).
PART_BYTES = 256 << 10
_BATCH_TAG = b"\x1a"  # SessionRequest field 3 (batch), wire type 2 (length-delimited)
_OVERHEAD = 16  # the outer tag and length, with room to spare


def limit_from(metadata: Sequence[tuple[str, str | bytes]] | None) -> int:
    """The largest batch (bytes) the daemon announced in its initial metadata; 0 when it did
    not (it takes single submits only)."""
    for key, value in metadata or ():
        if key == HEADER:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) if text.isdigit() else 0
    return 0


def encode(singles: Sequence[bytes]) -> bytes:
    """The serialized SessionRequest{batch} holding the submits whose serialized
    SessionRequest{submit} messages are `singles`, in order."""
    body = b"".join(singles)
    return _BATCH_TAG + _varint(len(body)) + body


def groups(singles: Iterable[bytes], limit: int) -> Iterator[list[bytes]]:
    """`singles` in order, cut into runs whose batch stays within `limit` bytes (a submit
    larger than that goes alone, as it would without batches). Callers pass the daemon's
    announced limit or PART_BYTES, the smaller. Lazy: a run is handed out as soon as the
    next submit would not fit, so the first part goes out before the rest is serialized."""
    run: list[bytes] = []
    size = _OVERHEAD
    for one in singles:
        if run and size + len(one) > limit:
            yield run
            run, size = [], _OVERHEAD
        run.append(one)
        size += len(one)
    if run:
        yield run


def _varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
