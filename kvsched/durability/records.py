"""The journal's subjects and records (their format is documented in journal.proto).

Pure functions: no I/O. A request id becomes one subject token in unpadded base64url, so any
id (dots, spaces, wildcards) is safe in a subject.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import dataclass, field

from kvsched.v1 import journal_pb2, request_service_pb2

STREAM = "KVSCHED_JOURNAL"
PREFIX = "kvsched.journal"
REQ = f"{PREFIX}.req"
DONE = f"{PREFIX}.done"
TOK = f"{PREFIX}.tok"
# At a finish: the accepted record is replaced by an empty message that expires (the `req` tree
# then holds live requests only, and recovery reads nothing of finished ones).
TOMBSTONE_HEADERS = {"Nats-Rollup": "sub", "Nats-TTL": "2s"}
ROLLUP = {"Nats-Rollup": "sub"}
ADOPTED_BY = "Kvsched-Adopted-By"  # header of a takeover's tombstone: the adopting daemon
# Header of the tombstone that follows a refused accepted record (the client was told that
# nothing was accepted): a lookup reads it as "never accepted here", not as a record in transit.
REFUSED = "Kvsched-Refused"
REFUSED_HEADERS = {**TOMBSTONE_HEADERS, REFUSED: "1"}
MAX_BATCH_TOKENS = 200_000  # per TokenBatch message: under NATS's 1 MB default max_payload

ACCEPTED = journal_pb2.JournalRecord.KIND_ACCEPTED
FINISHED = journal_pb2.JournalRecord.KIND_FINISHED


def pack_tokens(tokens: list[int]) -> bytes:
    """Token ids as int32 little-endian bytes."""
    a = array("i", tokens)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def id_token(req_id: str) -> str:
    """A request id as one subject token."""
    return base64.urlsafe_b64encode(req_id.encode()).rstrip(b"=").decode()


def id_from_token(token: str) -> str:
    return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()


def req_subject(daemon_id: str, req_id: str) -> str:
    return f"{REQ}.{daemon_id}.{id_token(req_id)}"


def done_subject(req_id: str) -> str:
    return f"{DONE}.{id_token(req_id)}"


def tok_subject(daemon_id: str) -> str:
    return f"{TOK}.{daemon_id}"


def accepted_record(
    pb: request_service_pb2.GenerateRequest,
    req_id: str,
    daemon_id: str,
    instance: str,
    principal: str,
    client_tag: str,
) -> bytes:
    rec = journal_pb2.JournalRecord(
        kind=ACCEPTED,
        request_id=req_id,
        daemon_id=daemon_id,
        instance=instance,
        principal=principal,
        client_tag=client_tag,
    )
    rec.request.CopyFrom(pb)
    rec.request.request_id = req_id
    return rec.SerializeToString()


def finished_record(
    req_id: str,
    daemon_id: str,
    principal: str,
    tokens: list[int],
    finished: request_service_pb2.Finished,
) -> bytes:
    rec = journal_pb2.JournalRecord(
        kind=FINISHED, request_id=req_id, daemon_id=daemon_id, principal=principal
    )
    rec.output_tokens_le = pack_tokens(tokens)
    rec.finished.CopyFrom(finished)
    return rec.SerializeToString()


def token_batches(entries: list[tuple[str, int, list[int]]]) -> list[bytes]:
    """(request id, start, tokens) entries as TokenBatch messages of at most MAX_BATCH_TOKENS
    tokens each (an entry is never split)."""
    out: list[bytes] = []
    batch = journal_pb2.TokenBatch()
    toks: list[int] = []
    for rid, start, t in entries:
        if toks and len(toks) + len(t) > MAX_BATCH_TOKENS:
            batch.tokens_le = pack_tokens(toks)
            out.append(batch.SerializeToString())
            batch, toks = journal_pb2.TokenBatch(), []
        batch.request_ids.append(rid)
        batch.starts.append(start)
        batch.counts.append(len(t))
        toks += t
    if toks or batch.request_ids:
        batch.tokens_le = pack_tokens(toks)
        out.append(batch.SerializeToString())
    return out


def parse_record(data: bytes) -> journal_pb2.JournalRecord:
    rec = journal_pb2.JournalRecord()
    rec.ParseFromString(data)
    return rec


def finished_tokens(rec: journal_pb2.JournalRecord) -> list[int]:
    """A finished record's output tokens."""
    return unpack_tokens(rec.output_tokens_le)


def apply_batch(tokens_of: dict[str, list[int]], data: bytes) -> None:
    """Apply one TokenBatch to the tokens known so far (in place), for the requests in
    `tokens_of`. An entry past a request's known tokens is a gap (records lost while NATS was
    unreachable): ignored, the next compaction repairs it."""
    b = journal_pb2.TokenBatch()
    b.ParseFromString(data)
    toks = unpack_tokens(b.tokens_le)
    i = 0
    for rid, start, count in zip(b.request_ids, b.starts, b.counts, strict=True):
        have = tokens_of.get(rid)
        if have is not None and start <= len(have):
            del have[start:]
            have.extend(toks[i : i + count])
        i += count


@dataclass
class Unfinished:
    """A request the journal holds as accepted and not finished: what recovery replays."""

    record: journal_pb2.JournalRecord
    tokens: list[int] = field(default_factory=list)
    seq: int = 0  # the stream sequence of its accepted record (a takeover's compare-and-set)
